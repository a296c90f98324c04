# Sourced by scripts/test: make sure Postgres and Redis answer, starting private ones when absent.
# Exports PHALANX_TEST_DATABASE_URL and PHALANX_TEST_REDIS_URL for the test suite.

PHALANX_TEST_DATABASE_URL=${PHALANX_TEST_DATABASE_URL:-postgresql+psycopg://postgres@127.0.0.1:5432/test}
PHALANX_TEST_REDIS_URL=${PHALANX_TEST_REDIS_URL:-redis://127.0.0.1:6379/15}
SERVICES_DIR=${SERVICES_DIR:-$PWD/.phalanx/test-services}

_py() { .venv/bin/python - "$@"; }

postgres_answers() {
  _py "$1" <<'PY'
import sys, psycopg
url = sys.argv[1].replace("postgresql+psycopg://", "postgresql://")
try:
    psycopg.connect(url, connect_timeout=3).close()
except Exception as exc:
    print(f"postgres at {url}: {exc}", file=sys.stderr)
    sys.exit(1)
PY
}

redis_answers() {
  _py "$1" <<'PY'
import sys, redis
try:
    redis.Redis.from_url(sys.argv[1], socket_connect_timeout=3).ping()
except Exception as exc:
    print(f"redis at {sys.argv[1]}: {exc}", file=sys.stderr)
    sys.exit(1)
PY
}

start_private_postgres() {
  local bindir port=55432 data="$SERVICES_DIR/pg"
  bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  if [ -z "$bindir" ] && command -v pg_ctl >/dev/null; then bindir=$(dirname "$(command -v pg_ctl)"); fi
  if [ -z "$bindir" ]; then
    echo "error: no PostgreSQL answers at $PHALANX_TEST_DATABASE_URL and pg_ctl is not installed." >&2
    echo "       Install it (Debian: apt-get install postgresql) or point PHALANX_TEST_DATABASE_URL at one." >&2
    return 1
  fi
  mkdir -p "$SERVICES_DIR"
  local run=()
  # initdb refuses to run as root: run the private cluster as the postgres user when we are root
  if [ "$(id -u)" = 0 ]; then
    id postgres >/dev/null 2>&1 || { echo "error: running as root and no 'postgres' user to own a private cluster" >&2; return 1; }
    chown postgres "$SERVICES_DIR"; run=(runuser -u postgres --)
  fi
  if [ ! -f "$data/PG_VERSION" ]; then
    "${run[@]}" "$bindir/initdb" -D "$data" -U postgres --auth=trust >/dev/null
  fi
  "${run[@]}" "$bindir/pg_ctl" -D "$data" -l "$data.log" -o "-p $port -k /tmp -c listen_addresses=127.0.0.1" -w start >/dev/null
  "${run[@]}" "$bindir/psql" -h 127.0.0.1 -p $port -U postgres -tc "SELECT 1 FROM pg_database WHERE datname='test'" | grep -q 1 \
    || "${run[@]}" "$bindir/createdb" -h 127.0.0.1 -p $port -U postgres test
  PHALANX_TEST_DATABASE_URL="postgresql+psycopg://postgres@127.0.0.1:$port/test"
  echo "started a private PostgreSQL at $PHALANX_TEST_DATABASE_URL (data in $data)"
}

start_private_redis() {
  local port=56379
  if ! command -v redis-server >/dev/null; then
    echo "error: no Redis answers at $PHALANX_TEST_REDIS_URL and redis-server is not installed." >&2
    echo "       Install it (Debian: apt-get install redis-server) or point PHALANX_TEST_REDIS_URL at one." >&2
    return 1
  fi
  mkdir -p "$SERVICES_DIR"
  # as docker-compose.yml runs it (docs/deploy.md, "Redis for the data plane")
  JE_MALLOC_CONF=dirty_decay_ms:-1 MALLOC_CONF=dirty_decay_ms:-1 \
    redis-server --daemonize yes --bind 127.0.0.1 --port $port --save "" --appendonly no \
      --dir "$SERVICES_DIR" --logfile "$SERVICES_DIR/redis.log" >/dev/null
  for _ in $(seq 50); do redis_answers "redis://127.0.0.1:$port/15" 2>/dev/null && break; sleep 0.1; done
  PHALANX_TEST_REDIS_URL="redis://127.0.0.1:$port/15"
  echo "started a private Redis at $PHALANX_TEST_REDIS_URL"
}

ensure_services() {
  postgres_answers "$PHALANX_TEST_DATABASE_URL" 2>/dev/null || start_private_postgres || return 1
  postgres_answers "$PHALANX_TEST_DATABASE_URL" || return 1
  redis_answers "$PHALANX_TEST_REDIS_URL" 2>/dev/null || start_private_redis || return 1
  redis_answers "$PHALANX_TEST_REDIS_URL" || return 1
  export PHALANX_TEST_DATABASE_URL PHALANX_TEST_REDIS_URL
}

# tests/deploy runs the real promtool and Prometheus: find them, or install Debian's package when
# we may (root with apt-get), or say how to get them. Exports PHALANX_TEST_PROMETHEUS/_PROMTOOL.
ensure_prometheus() {
  if [ -x "${PHALANX_TEST_PROMETHEUS:-}" ] && [ -x "${PHALANX_TEST_PROMTOOL:-}" ]; then
    export PHALANX_TEST_PROMETHEUS PHALANX_TEST_PROMTOOL; return 0
  fi
  if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "installing Debian's prometheus package (promtool + Prometheus, for tests/deploy)"
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
             apt-get install -y -q --no-install-recommends prometheus >/dev/null; } || true
    fi
  fi
  if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
    echo "error: tests/deploy needs Prometheus and promtool on PATH." >&2
    echo "       Install them (Debian: apt-get install prometheus; or the release tarball from" >&2
    echo "       prometheus.io) or set PHALANX_TEST_PROMETHEUS and PHALANX_TEST_PROMTOOL." >&2
    return 1
  fi
  PHALANX_TEST_PROMETHEUS=${PHALANX_TEST_PROMETHEUS:-$(command -v prometheus)}
  PHALANX_TEST_PROMTOOL=${PHALANX_TEST_PROMTOOL:-$(command -v promtool)}
  export PHALANX_TEST_PROMETHEUS PHALANX_TEST_PROMTOOL
}

# A real headless browser for the pages' tests (tests/cli/test_report.py): Debian's chromium.
ensure_chromium() {
  if [ -x "${PHALANX_TEST_CHROMIUM:-}" ]; then export PHALANX_TEST_CHROMIUM; return 0; fi
  if ! command -v chromium >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "installing Debian's chromium package (a headless browser for the page tests)"
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
             apt-get install -y -q --no-install-recommends chromium >/dev/null; } || true
    fi
  fi
  if ! command -v chromium >/dev/null; then
    echo "error: the page tests need a headless Chromium on PATH." >&2
    echo "       Install it (Debian: apt-get install chromium) or set PHALANX_TEST_CHROMIUM." >&2
    return 1
  fi
  PHALANX_TEST_CHROMIUM=$(command -v chromium)
  export PHALANX_TEST_CHROMIUM
}
