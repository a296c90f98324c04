-- A read-only role for Grafana's PostgreSQL datasource: it reads every table Phalanx has or will
-- have (later migrations included, through the owner's default privileges) and changes nothing.
-- Idempotent. psql variables: grafana_password, and owner (the role that runs the migrations).
--   psql -v grafana_password=... -v owner=phalanx -d phalanx -f grafana-readonly.sql
-- (docker compose runs it at the database's first start: grafana-readonly.sh)
SELECT 'CREATE ROLE grafana_ro LOGIN' WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'grafana_ro')
\gexec
ALTER ROLE grafana_ro WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD :'grafana_password';
ALTER ROLE grafana_ro SET default_transaction_read_only = on;
GRANT USAGE ON SCHEMA public TO grafana_ro;
GRANT SELECT ON ALL TABLES IN SCHEMA public TO grafana_ro;
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA public GRANT SELECT ON TABLES TO grafana_ro;
