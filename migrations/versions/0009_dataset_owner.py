"""Tenancy of datasets: datasets.owner, datasets.public and datasets.stored_bytes

Datasets uploaded before this revision recorded no uploader: they become the admins' (owner
NULL) and not public. Nobody can tell whose they were, and making them public would keep
showing one user's data to every other; an admin shares one that should be seen by all with
`phalanx datasets share NAME` (docs/api.md, "Datasets"). Their stored_bytes (what the per-user
quota counts) is their file's size_bytes: the migration does not walk the data folder.

Revision ID: 0009_dataset_owner
Revises: 0008_job_compute_class
"""

import sqlalchemy as sa
from alembic import op

revision = '0009_dataset_owner'
down_revision = '0008_job_compute_class'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('datasets', schema=None) as batch_op:
        batch_op.add_column(sa.Column('owner', sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column('public', sa.Boolean(), server_default=sa.false(),
                                      nullable=False))
        batch_op.add_column(sa.Column('stored_bytes', sa.BigInteger(), server_default='0',
                                      nullable=False))
        batch_op.create_index(batch_op.f('ix_datasets_owner'), ['owner'], unique=False)
    op.execute("UPDATE datasets SET stored_bytes = size_bytes")


def downgrade() -> None:
    with op.batch_alter_table('datasets', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_datasets_owner'))
        batch_op.drop_column('stored_bytes')
        batch_op.drop_column('public')
        batch_op.drop_column('owner')
