#!/bin/sh
# Run by the postgres image at the database's first start (/docker-entrypoint-initdb.d): the
# read-only role Grafana's datasource logs in as (deploy/postgres/grafana-readonly.sql).
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
  -v grafana_password="$GRAFANA_DB_PASSWORD" -v owner="$POSTGRES_USER" \
  -f /phalanx/grafana-readonly.sql
