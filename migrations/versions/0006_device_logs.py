"""An agent's recent log lines, shipped on request: devices.logs_requested_at, device_logs

Revision ID: 0006_device_logs
Revises: 0005_job_plan
"""

import sqlalchemy as sa
from alembic import op


revision = '0006_device_logs'
down_revision = '0005_job_plan'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.add_column(sa.Column('logs_requested_at', sa.DateTime(timezone=True), nullable=True))
    op.create_table('device_logs',
    sa.Column('device_id', sa.String(length=40), nullable=False),
    sa.Column('shipped_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('lines', sa.JSON(), nullable=False),
    sa.Column('created', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.Column('updated', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.ForeignKeyConstraint(['device_id'], ['devices.id'], name=op.f('fk_device_logs_device_id_devices'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('device_id', name=op.f('pk_device_logs'))
    )


def downgrade() -> None:
    op.drop_table('device_logs')
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.drop_column('logs_requested_at')
