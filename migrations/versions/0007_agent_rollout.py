"""Agents that upgrade themselves: agent_rollouts, devices.upgrade_to/upgrade_started_at/upgrade_failed

Revision ID: 0007_agent_rollout
Revises: 0006_device_logs
"""

import sqlalchemy as sa
from alembic import op


revision = '0007_agent_rollout'
down_revision = '0006_device_logs'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.add_column(sa.Column('upgrade_to', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('upgrade_started_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('upgrade_failed', sa.String(length=40), nullable=True))
    op.create_table('agent_rollouts',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('version', sa.String(length=40), nullable=False),
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('max_parallel', sa.Integer(), nullable=False),
    sa.Column('set_by', sa.String(length=200), nullable=True),
    sa.Column('created', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.Column('updated', sa.DateTime(timezone=True), server_default=sa.text('(CURRENT_TIMESTAMP)'), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_agent_rollouts'))
    )


def downgrade() -> None:
    op.drop_table('agent_rollouts')
    with op.batch_alter_table('devices', schema=None) as batch_op:
        batch_op.drop_column('upgrade_failed')
        batch_op.drop_column('upgrade_started_at')
        batch_op.drop_column('upgrade_to')
