"""The job's plan at submit (parameters, FLOPs, memory per phone): jobs.plan

Revision ID: 0005_job_plan
Revises: 0004_state_nonce
"""

import sqlalchemy as sa
from alembic import op

revision = '0005_job_plan'
down_revision = '0004_state_nonce'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('plan', sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('plan')
