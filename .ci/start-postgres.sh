#!/usr/bin/env bash
# Start a throw-away PostgreSQL server from Debian's packages for the shared-study test, and print the
# storage URL for it. Usage: url=$(.ci/start-postgres.sh)   (installs postgresql if it is missing)
set -euo pipefail
if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql) >&2
fi
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
data=$(mktemp -d /tmp/tctune-pg.XXXXXX)
port=${TCTUNE_PG_PORT:-55432}
run() { if [ "$(id -u)" = 0 ]; then su postgres -s /bin/sh -c "$*"; else sh -c "$*"; fi; }
[ "$(id -u)" = 0 ] && chown postgres "$data"
run "'$bin/initdb' -D '$data' -A trust -U postgres" >&2
run "'$bin/pg_ctl' -D '$data' -o '-p $port -k /tmp -c listen_addresses=127.0.0.1' -l '$data/log' -w start" >&2
echo "postgresql+psycopg2://postgres@127.0.0.1:$port/postgres"
