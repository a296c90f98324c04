"""The hot state's name per committed step: jobs.state_nonce

Revision ID: 0004_state_nonce
Revises: 0003_job_owner
"""

import sqlalchemy as sa
from alembic import op

revision = '0004_state_nonce'
down_revision = '0003_job_owner'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('state_nonce', sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_column('state_nonce')
