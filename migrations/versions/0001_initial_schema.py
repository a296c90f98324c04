"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-12-02
"""
from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    
    op.create_table('datasets',
    sa.Column('name', sa.String(length=100), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('n_samples', sa.Integer(), nullable=False),
    sa.Column('input_shape', sa.JSON(), nullable=False),
    sa.Column('num_classes', sa.Integer(), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('created', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.Column('updated', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_datasets'))
    )
    op.create_table('devices',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('labels', sa.JSON(), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('state', sa.String(length=20), nullable=False),
    sa.Column('cordoned', sa.Boolean(), nullable=False),
    sa.Column('draining', sa.Boolean(), nullable=False),
    sa.Column('pause_reason', sa.String(length=40), nullable=True),
    sa.Column('lease_renewed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('agent_version', sa.String(length=40), nullable=True),
    sa.Column('capabilities', sa.JSON(), nullable=False),
    sa.Column('profiles', sa.JSON(), nullable=False),
    sa.Column('latest_telemetry', sa.JSON(), nullable=False),
    sa.Column('latest_telemetry_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.Column('updated', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_devices'))
    )
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_devices_lease_renewed_at'), ['lease_renewed_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_devices_name'), ['name'], unique=False)
        batch_op.create_index(batch_op.f('ix_devices_state'), ['state'], unique=False)

    op.create_table('enrollment_tokens',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('max_uses', sa.Integer(), nullable=True),
    sa.Column('uses', sa.Integer(), nullable=False),
    sa.Column('revoked', sa.Boolean(), nullable=False),
    sa.Column('labels', sa.JSON(), nullable=False),
    sa.Column('description', sa.String(length=200), nullable=True),
    sa.Column('created', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.Column('updated', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_enrollment_tokens')),
    sa.UniqueConstraint('token_hash', name=op.f('uq_enrollment_tokens_token_hash'))
    )
    op.create_table('jobs',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('state', sa.String(length=20), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('total_steps', sa.Integer(), nullable=False),
    sa.Column('metrics', sa.JSON(), nullable=False),
    sa.Column('owner_token_id', sa.String(length=40), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('step_started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.Column('updated', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs'))
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_jobs_state'), ['state'], unique=False)

    op.create_table('api_tokens',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('kind', sa.String(length=10), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=True),
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('device_id', sa.String(length=40), nullable=True),
    sa.Column('revoked', sa.Boolean(), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.Column('updated', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.ForeignKeyConstraint(['device_id'], ['devices.id'], name=op.f('fk_api_tokens_device_id_devices'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_tokens')),
    sa.UniqueConstraint('token_hash', name=op.f('uq_api_tokens_token_hash'))
    )
    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_tokens_device_id'), ['device_id'], unique=False)

    op.create_table('checkpoints',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('created', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.Column('updated', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_checkpoints_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_checkpoints'))
    )
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_checkpoints_job_id'), ['job_id'], unique=False)

    op.create_table('events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('ts', sa.DateTime(timezone=True), nullable=False),
    sa.Column('job_id', sa.String(length=40), nullable=True),
    sa.Column('device_id', sa.String(length=40), nullable=True),
    sa.Column('kind', sa.String(length=10), nullable=False),
    sa.Column('reason', sa.String(length=60), nullable=False),
    sa.Column('message', sa.Text(), nullable=False),
    sa.Column('data', sa.JSON(), nullable=False),
    sa.Column('created', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.Column('updated', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_events_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_events'))
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_events_device_id'), ['device_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_events_job_id'), ['job_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_events_ts'), ['ts'], unique=False)

    op.create_table('shard_assignments',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('shard', sa.Integer(), nullable=False),
    sa.Column('device_id', sa.String(length=40), nullable=False),
    sa.Column('role', sa.String(length=10), nullable=False),
    sa.Column('since_step', sa.Integer(), nullable=False),
    sa.Column('created', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.Column('updated', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.ForeignKeyConstraint(['device_id'], ['devices.id'], name=op.f('fk_shard_assignments_device_id_devices'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_shard_assignments_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_shard_assignments')),
    sa.UniqueConstraint('job_id', 'shard', 'role', name='uq_shard_role')
    )
    with op.batch_alter_table('shard_assignments', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_shard_assignments_device_id'), ['device_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_shard_assignments_job_id'), ['job_id'], unique=False)

    op.create_table('step_metrics',
    sa.Column('job_id', sa.String(length=40), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('ts', sa.DateTime(timezone=True), nullable=False),
    sa.Column('epoch', sa.Float(), nullable=False),
    sa.Column('train_loss', sa.Float(), nullable=True),
    sa.Column('train_accuracy', sa.Float(), nullable=True),
    sa.Column('val_loss', sa.Float(), nullable=True),
    sa.Column('val_accuracy', sa.Float(), nullable=True),
    sa.Column('lr', sa.Float(), nullable=True),
    sa.Column('samples', sa.Integer(), nullable=False),
    sa.Column('step_seconds', sa.Float(), nullable=True),
    sa.Column('devices', sa.Integer(), nullable=False),
    sa.Column('energy_j', sa.Float(), nullable=True),
    sa.Column('created', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.Column('updated', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_step_metrics_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', 'step', name=op.f('pk_step_metrics'))
    )
    op.create_table('telemetry_samples',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('device_id', sa.String(length=40), nullable=False),
    sa.Column('ts', sa.DateTime(timezone=True), nullable=False),
    sa.Column('battery_pct', sa.Float(), nullable=True),
    sa.Column('charging', sa.Boolean(), nullable=True),
    sa.Column('battery_temp_c', sa.Float(), nullable=True),
    sa.Column('cpu_temp_c', sa.Float(), nullable=True),
    sa.Column('power_w', sa.Float(), nullable=True),
    sa.Column('cpu_freq_mhz', sa.Float(), nullable=True),
    sa.Column('throttled', sa.Boolean(), nullable=True),
    sa.Column('busy', sa.Boolean(), nullable=True),
    sa.Column('created', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.Column('updated', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.ForeignKeyConstraint(['device_id'], ['devices.id'], name=op.f('fk_telemetry_samples_device_id_devices'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_telemetry_samples'))
    )
    with op.batch_alter_table('telemetry_samples', schema=None) as batch_op:
        batch_op.create_index('ix_telemetry_device_ts', ['device_id', 'ts'], unique=False)
        batch_op.create_index(batch_op.f('ix_telemetry_samples_ts'), ['ts'], unique=False)

    


def downgrade() -> None:
    
    with op.batch_alter_table('telemetry_samples', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_telemetry_samples_ts'))
        batch_op.drop_index('ix_telemetry_device_ts')

    op.drop_table('telemetry_samples')
    op.drop_table('step_metrics')
    with op.batch_alter_table('shard_assignments', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_shard_assignments_job_id'))
        batch_op.drop_index(batch_op.f('ix_shard_assignments_device_id'))

    op.drop_table('shard_assignments')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_events_ts'))
        batch_op.drop_index(batch_op.f('ix_events_job_id'))
        batch_op.drop_index(batch_op.f('ix_events_device_id'))

    op.drop_table('events')
    with op.batch_alter_table('checkpoints', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_checkpoints_job_id'))

    op.drop_table('checkpoints')
    with op.batch_alter_table('api_tokens', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_tokens_device_id'))

    op.drop_table('api_tokens')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_jobs_state'))

    op.drop_table('jobs')
    op.drop_table('enrollment_tokens')
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_devices_state'))
        batch_op.drop_index(batch_op.f('ix_devices_name'))
        batch_op.drop_index(batch_op.f('ix_devices_lease_renewed_at'))

    op.drop_table('devices')
    op.drop_table('datasets')
    
