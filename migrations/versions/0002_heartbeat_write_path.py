"""Heartbeat write path: HOT-friendly devices, BRIN ts index for telemetry pruning

Revision ID: 0002_heartbeat_write_path
Revises: 0001
"""

from alembic import op

revision = '0002_heartbeat_write_path'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_devices_lease_renewed_at'))
    with op.batch_alter_table('telemetry_samples', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_telemetry_samples_ts'))
        batch_op.create_index('ix_telemetry_ts_brin', ['ts'], unique=False,
                              postgresql_using='brin')
    if op.get_bind().dialect.name == 'postgresql':
        # room in each page for the new row version, so lease renewals stay HOT updates
        op.execute('ALTER TABLE devices SET (fillfactor = 50)')


def downgrade() -> None:
    if op.get_bind().dialect.name == 'postgresql':
        op.execute('ALTER TABLE devices RESET (fillfactor)')
    with op.batch_alter_table('telemetry_samples', schema=None) as batch_op:
        batch_op.drop_index('ix_telemetry_ts_brin', postgresql_using='brin')
        batch_op.create_index(batch_op.f('ix_telemetry_samples_ts'), ['ts'], unique=False)
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_devices_lease_renewed_at'), ['lease_renewed_at'],
                              unique=False)
