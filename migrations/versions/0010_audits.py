"""Audits (issue 41): devices.quarantine_reason, jobs.audit_key, shard_assignments.span (an
audited node's shards) and audit_records (each device's audited steps and first unaudited
result, per job)

Jobs from before this revision have no audit key: their id stands in (scheduler.audits), and
their specs carry no `verification`, so they audit nothing unless submitted again.

Revision ID: 0010_audits
Revises: 0009_dataset_owner
"""

import sqlalchemy as sa
from alembic import op

revision = '0010_audits'
down_revision = '0009_dataset_owner'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.add_column(sa.Column('quarantine_reason', sa.Text(), nullable=True))
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('audit_key', sa.String(length=32), nullable=True))
    with op.batch_alter_table('shard_assignments', schema=None) as batch_op:
        batch_op.add_column(sa.Column('span', sa.Integer(), server_default='1', nullable=False))
    op.create_table(
        'audit_records',
        sa.Column('job_id', sa.String(length=40), nullable=False),
        sa.Column('device_id', sa.String(length=40), nullable=False),
        sa.Column('verified_steps', sa.Integer(), nullable=False),
        sa.Column('first_unaudited_step', sa.Integer(), nullable=True),
        sa.Column('created', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'),
                  nullable=False),
        sa.Column('updated', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'),
                  nullable=False),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id'],
                                name=op.f('fk_audit_records_job_id_jobs'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('job_id', 'device_id', name=op.f('pk_audit_records')),
    )


def downgrade() -> None:
    op.drop_table('audit_records')
    with op.batch_alter_table('shard_assignments', schema=None) as batch_op:
        batch_op.drop_column('span')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('audit_key')
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.drop_column('quarantine_reason')
