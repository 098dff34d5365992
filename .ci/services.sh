# shellcheck shell=bash
# Make sure the local services the tests and the demo need are up. Sourced by .ci/run,
# .ci/test and .ci/demo; every wait has a deadline. Starts only what is down: never
# restarts or stops a running broker (other processes may be using it).
#
#   ensure_rabbitmq     RabbitMQ answering on $RD_AMQP_HOST:$RD_AMQP_PORT (127.0.0.1:5672). When
#                       nothing answers, the first of these that applies:
#                         1. Docker answers (docker info, docker compose): docker compose up -d --wait rabbitmq
#                         2. rabbitmq-server is installed: start it (rabbitmq-server -detached)
#                         3. root and apt-get: apt-get install -y rabbitmq-server, then start it
#                         4. otherwise one error saying what to install
#   ensure_management   the management HTTP API answering on 127.0.0.1:15672 (the Docker
#                       image has it; a local broker gets rabbitmq_management enabled)
#   ensure_redis        Redis answering PING on 127.0.0.1:6379
#   ensure_postgres     PostgreSQL accepting connections on 127.0.0.1:$RD_PG_PORT (5432), database
#                       $RD_PG_DB (test) present: the outbox tests and bench_outbox use it. When
#                       down: the machine's cluster is started (pg_ctlcluster), else one error
#   ensure_chromium     Debian's chromium and chromium-driver (/usr/bin/chromium), which the
#                       dashboard's browser test drives: installed with apt-get when missing
#                       and we are root; otherwise a warning (the test then fails, naming
#                       what to install: it is never skipped)
#   ensure_node         Node.js and npm (Debian's nodejs and npm, installed with apt-get when
#                       missing and we are root; otherwise a warning, and the interop test
#                       fails naming them), then `npm ci` in $RD_NODE_DIR (tests/interop/node:
#                       amqplib as its package-lock.json pins it) when its node_modules is
#                       missing or older than the lock file
#   ensure_nftables     nft (Debian's nftables, installed with apt-get when missing and we are
#                       root), which the partition tests use inside network namespaces

RD_AMQP_HOST=${RD_AMQP_HOST:-127.0.0.1}
RD_AMQP_PORT=${RD_AMQP_PORT:-5672}
RD_MANAGEMENT_URL=${RD_MANAGEMENT_URL:-http://127.0.0.1:15672}
RD_REDIS_PORT=${RD_REDIS_PORT:-6379}
RD_PG_PORT=${RD_PG_PORT:-5432}
RD_PG_DB=${RD_PG_DB:-test}
RD_START_TIMEOUT=${RD_START_TIMEOUT:-120}
RD_INSTALL_TIMEOUT=${RD_INSTALL_TIMEOUT:-600}  # docker image pull + start, or apt-get install
RD_COMPOSE_FILE=${RD_COMPOSE_FILE:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/docker-compose.yml}
RD_RABBITMQ_FROM=""  # set by ensure_rabbitmq when it started a broker: docker or local

_say() { printf '[services] %s\n' "$*"; }
_die() { printf '[services] ERROR: %s\n' "$*" >&2; return 1; }

port_open() {  # port_open HOST PORT
    timeout 3 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local seconds=$1 what=$2 deadline
    shift 2
    deadline=$((SECONDS + seconds))
    until "$@"; do
        if ((SECONDS >= deadline)); then
            _die "$what not ready after ${seconds}s"
            return 1
        fi
        sleep 1
    done
}

docker_answers() {  # a Docker engine that answers, and the compose plugin to use it
    command -v docker >/dev/null 2>&1 && timeout 20 docker info >/dev/null 2>&1 \
        && timeout 20 docker compose version >/dev/null 2>&1
}

ensure_rabbitmq() {
    if port_open "$RD_AMQP_HOST" "$RD_AMQP_PORT"; then
        _say "RabbitMQ answers on $RD_AMQP_HOST:$RD_AMQP_PORT"
        return 0
    fi
    if docker_answers; then
        _rabbitmq_docker
    else
        _rabbitmq_local
    fi
}

_rabbitmq_docker() {
    _say "no RabbitMQ on $RD_AMQP_HOST:$RD_AMQP_PORT; Docker answers: docker compose up -d --wait rabbitmq (up to ${RD_INSTALL_TIMEOUT}s)"
    timeout "$RD_INSTALL_TIMEOUT" docker compose -f "$RD_COMPOSE_FILE" up -d --wait rabbitmq \
        || _die "docker compose up -d --wait rabbitmq failed; see: docker compose -f $RD_COMPOSE_FILE logs rabbitmq" \
        || return 1
    RD_RABBITMQ_FROM=docker
    wait_for 30 "RabbitMQ port $RD_AMQP_PORT" port_open "$RD_AMQP_HOST" "$RD_AMQP_PORT" || return 1
    _say "RabbitMQ is up (Docker service rabbitmq)"
}

_rabbitmq_local() {
    if ! command -v rabbitmq-server >/dev/null 2>&1; then
        if [ "$(id -u 2>/dev/null)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            _say "no RabbitMQ on $RD_AMQP_HOST:$RD_AMQP_PORT, no Docker: apt-get install -y rabbitmq-server"
            { timeout "$RD_INSTALL_TIMEOUT" apt-get update -qq \
                && DEBIAN_FRONTEND=noninteractive timeout "$RD_INSTALL_TIMEOUT" apt-get install -y -qq rabbitmq-server; } \
                || _die "apt-get install rabbitmq-server failed" || return 1
            command -v rabbitmq-server >/dev/null 2>&1 \
                || _die "rabbitmq-server is still not on PATH after apt-get install" || return 1
        else
            _die "no RabbitMQ on $RD_AMQP_HOST:$RD_AMQP_PORT, no Docker engine answers (docker info) and rabbitmq-server is not installed (installing it here needs root and apt-get).
    Install Docker with Compose (then: docker compose up -d rabbitmq) or rabbitmq-server (e.g. sudo apt-get install rabbitmq-server), and run this again."
            return 1
        fi
    fi
    # The node may be up but still booting; only start it when rabbitmqctl cannot reach it.
    if ! timeout 30 rabbitmqctl -q status >/dev/null 2>&1; then
        _say "starting RabbitMQ (rabbitmq-server -detached)"
        rabbitmq-server -detached
    fi
    RD_RABBITMQ_FROM=local
    _say "waiting for RabbitMQ to finish booting (up to ${RD_START_TIMEOUT}s)"
    timeout $((RD_START_TIMEOUT + 10)) rabbitmqctl -q await_startup --timeout "$RD_START_TIMEOUT" \
        || _die "RabbitMQ did not start; see its logs under /var/log/rabbitmq" || return 1
    wait_for 30 "RabbitMQ port $RD_AMQP_PORT" port_open "$RD_AMQP_HOST" "$RD_AMQP_PORT" || return 1
    _say "RabbitMQ is up"
}

management_answers() {
    if command -v curl >/dev/null 2>&1; then
        curl -fsS -m 3 -u guest:guest -o /dev/null "$RD_MANAGEMENT_URL/api/overview" 2>/dev/null
    else
        python3 - "$RD_MANAGEMENT_URL/api/overview" <<'PY' 2>/dev/null
import base64, sys, urllib.request
req = urllib.request.Request(sys.argv[1], headers={"Authorization": "Basic " + base64.b64encode(b"guest:guest").decode()})
urllib.request.urlopen(req, timeout=3).read()
PY
    fi
}

ensure_management() {
    if management_answers; then
        _say "management API answers on $RD_MANAGEMENT_URL"
        return 0
    fi
    if [ "$RD_RABBITMQ_FROM" = docker ]; then  # the image has it: it is only still starting
        wait_for 90 "management API at $RD_MANAGEMENT_URL" management_answers || return 1
        _say "management API is up"
        return 0
    fi
    _say "enabling rabbitmq_management"
    timeout 120 rabbitmq-plugins enable rabbitmq_management \
        || _die "rabbitmq-plugins enable rabbitmq_management failed" || return 1
    wait_for 90 "management API at $RD_MANAGEMENT_URL" management_answers || return 1
    _say "management API is up"
}

redis_answers() {
    if command -v redis-cli >/dev/null 2>&1; then
        [ "$(timeout 3 redis-cli -h 127.0.0.1 -p "$RD_REDIS_PORT" ping 2>/dev/null)" = "PONG" ]
    else
        timeout 3 bash -c "exec 3<>/dev/tcp/127.0.0.1/$RD_REDIS_PORT && printf 'PING\r\n' >&3 && head -c5 <&3 | grep -q PONG" 2>/dev/null
    fi
}

ensure_redis() {
    if redis_answers; then
        _say "Redis answers on 127.0.0.1:$RD_REDIS_PORT"
        return 0
    fi
    command -v redis-server >/dev/null 2>&1 \
        || _die "no Redis on 127.0.0.1:$RD_REDIS_PORT and redis-server is not installed (apt-get install redis-server)" \
        || return 1
    _say "starting Redis"
    mkdir -p /var/lib/redis /var/log/redis
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port "$RD_REDIS_PORT" --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/ci.log
    wait_for 30 "Redis on port $RD_REDIS_PORT" redis_answers || return 1
    _say "Redis is up"
}

postgres_answers() {
    if command -v pg_isready >/dev/null 2>&1; then
        timeout 5 pg_isready -q -h 127.0.0.1 -p "$RD_PG_PORT" 2>/dev/null
    else
        port_open 127.0.0.1 "$RD_PG_PORT"
    fi
}

_postgres_database() {  # the tests' database, created when missing (as the postgres user)
    command -v psql >/dev/null 2>&1 || return 0
    if ! timeout 10 psql -h 127.0.0.1 -p "$RD_PG_PORT" -U postgres -d "$RD_PG_DB" -Atc 'SELECT 1' >/dev/null 2>&1; then
        _say "creating PostgreSQL database $RD_PG_DB"
        timeout 10 psql -h 127.0.0.1 -p "$RD_PG_PORT" -U postgres -d postgres -c "CREATE DATABASE $RD_PG_DB" >/dev/null \
            || _die "could not create PostgreSQL database $RD_PG_DB" || return 1
    fi
}

ensure_postgres() {
    if postgres_answers; then
        _say "PostgreSQL answers on 127.0.0.1:$RD_PG_PORT"
        _postgres_database
        return
    fi
    if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ] && [ -n "$(ls /etc/postgresql 2>/dev/null)" ]; then
        local version
        version=$(ls /etc/postgresql | sort -V | tail -n 1)
        _say "starting PostgreSQL $version (pg_ctlcluster $version main start)"
        pg_ctlcluster --skip-systemctl-redirect "$version" main start \
            || _die "pg_ctlcluster $version main start failed; see /var/log/postgresql" || return 1
    else
        _die "no PostgreSQL on 127.0.0.1:$RD_PG_PORT and no cluster to start (apt-get install postgresql)" \
            || return 1
    fi
    wait_for 60 "PostgreSQL on port $RD_PG_PORT" postgres_answers || return 1
    _postgres_database || return 1
    _say "PostgreSQL is up"
}

RD_CHROMIUM=${RD_CHROMIUM:-/usr/bin/chromium}

ensure_chromium() {
    if [ -x "$RD_CHROMIUM" ]; then
        _say "Chromium: $("$RD_CHROMIUM" --version 2>/dev/null || echo "$RD_CHROMIUM")"
        return 0
    fi
    if [ "$(id -u 2>/dev/null)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        _say "no $RD_CHROMIUM: apt-get install -y chromium chromium-driver (for the dashboard's browser test)"
        if ! DEBIAN_FRONTEND=noninteractive timeout "$RD_INSTALL_TIMEOUT" apt-get install -y -qq chromium chromium-driver; then
            # a stale package list: refresh it once, then try again
            { timeout "$RD_INSTALL_TIMEOUT" apt-get update -qq \
                && DEBIAN_FRONTEND=noninteractive timeout "$RD_INSTALL_TIMEOUT" apt-get install -y -qq chromium chromium-driver; } \
                || _die "apt-get install chromium chromium-driver failed" || return 1
        fi
        [ -x "$RD_CHROMIUM" ] || _die "$RD_CHROMIUM is still missing after apt-get install chromium" || return 1
        _say "Chromium installed: $("$RD_CHROMIUM" --version 2>/dev/null || echo "$RD_CHROMIUM")"
        return 0
    fi
    _say "WARNING: no $RD_CHROMIUM and cannot install it here (needs root and apt-get): the dashboard's browser test will fail; install Debian's chromium and chromium-driver"
}

RD_NODE_DIR=${RD_NODE_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/tests/interop/node}

_apt_install() {  # _apt_install PACKAGE...: apt-get install, refreshing a stale package list once
    if ! DEBIAN_FRONTEND=noninteractive timeout "$RD_INSTALL_TIMEOUT" apt-get install -y -qq "$@"; then
        timeout "$RD_INSTALL_TIMEOUT" apt-get update -qq \
            && DEBIAN_FRONTEND=noninteractive timeout "$RD_INSTALL_TIMEOUT" apt-get install -y -qq "$@"
    fi
}

ensure_node() {
    local missing=()
    if ! command -v node >/dev/null 2>&1; then
        missing=(nodejs npm)
    elif ! command -v npm >/dev/null 2>&1; then
        missing=(npm)  # NodeSource's nodejs bundles npm (and conflicts with Debian's npm)
    fi
    if [ ${#missing[@]} -gt 0 ]; then
        if [ "$(id -u 2>/dev/null)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            _say "no ${missing[*]}: apt-get install -y ${missing[*]} (for the Node.js interop test)"
            _apt_install "${missing[@]}" || _die "apt-get install ${missing[*]} failed" || return 1
        else
            _say "WARNING: no ${missing[*]} and cannot install them here (needs root and apt-get): the Node.js interop test will fail; install Debian's nodejs and npm"
            return 0
        fi
    fi
    command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 \
        || _die "node or npm still missing after apt-get install nodejs npm" || return 1
    _say "Node.js $(node --version), npm $(npm --version)"
    local installed="$RD_NODE_DIR/node_modules/.package-lock.json"
    if [ ! -f "$installed" ] || [ "$RD_NODE_DIR/package-lock.json" -nt "$installed" ]; then
        _say "npm ci in $RD_NODE_DIR (amqplib for the interop test)"
        timeout "$RD_INSTALL_TIMEOUT" npm ci --prefix "$RD_NODE_DIR" --no-audit --no-fund --loglevel=error \
            || _die "npm ci in $RD_NODE_DIR failed" || return 1
    fi
}

ensure_nftables() {  # nft, for the partition tests (tests/partitions: rules inside network namespaces)
    if command -v nft >/dev/null 2>&1; then
        _say "nftables: $(nft --version 2>/dev/null)"
        return 0
    fi
    if [ "$(id -u 2>/dev/null)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        _say "no nft: apt-get install -y nftables (for the partition tests)"
        _apt_install nftables || _die "apt-get install nftables failed" || return 1
        command -v nft >/dev/null 2>&1 || _die "nft still missing after apt-get install nftables" || return 1
        return 0
    fi
    _say "WARNING: no nft and cannot install it here (needs root and apt-get): the partition tests skip"
}
