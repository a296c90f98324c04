"""A `class` job's compute class, chosen at its first placement: jobs.compute_class

Revision ID: 0008_job_compute_class
Revises: 0007_agent_rollout
"""

import sqlalchemy as sa
from alembic import op

revision = '0008_job_compute_class'
down_revision = '0007_agent_rollout'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('compute_class', sa.String(length=16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('compute_class')
