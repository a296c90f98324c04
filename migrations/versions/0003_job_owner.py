"""Tenancy: jobs.owner, the user who sees, cancels and is limited by a job

Revision ID: 0003_job_owner
Revises: 0002_heartbeat_write_path
"""

import sqlalchemy as sa
from alembic import op

revision = '0003_job_owner'
down_revision = '0002_heartbeat_write_path'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('owner', sa.String(length=200), nullable=True))
        batch_op.create_index(batch_op.f('ix_jobs_owner'), ['owner'], unique=False)
    # jobs submitted before: their user token; admins' stay NULL
    op.execute("UPDATE jobs SET owner = (SELECT t.id FROM api_tokens t "
               "WHERE t.id = jobs.owner_token_id AND t.kind = 'user') "
               "WHERE owner_token_id IS NOT NULL")


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_jobs_owner'))
        batch_op.drop_column('owner')
