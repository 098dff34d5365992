#!/usr/bin/env bash
# RabbitMQ nodes for the tests and benchmarks, on ports of their own: never the machine's
# broker on 5672, which is neither stopped nor reconfigured here.
#
#   bash .ci/brokers.sh setup VERSION                  provision VERSION (idempotent)
#   bash .ci/brokers.sh start VERSION [NAME] [options]  start node NAME (default: main), wait until it answers
#   bash .ci/brokers.sh stop  VERSION [NAME]            graceful stop (SIGKILL at the deadline)
#   bash .ci/brokers.sh kill  VERSION NAME              SIGKILL the node (a crash, for fault tests)
#   bash .ci/brokers.sh url   VERSION [NAME]            its AMQP URL (guest/guest, loopback)
#   bash .ci/brokers.sh management-url VERSION [NAME]   its management API base URL
#   bash .ci/brokers.sh ctl   VERSION NAME ARGS...      rabbitmqctl against that node
#   bash .ci/brokers.sh logs  VERSION NAME [LINES]      the end of its logs
#   bash .ci/brokers.sh log-file VERSION [NAME]         the path of its main log
#   bash .ci/brokers.sh rm    VERSION NAME              SIGKILL it and delete its data
#   bash .ci/brokers.sh version VERSION                 the RabbitMQ version it runs (e.g. 4.3.6)
#   bash .ci/brokers.sh list                            nodes and whether they answer
#   bash .ci/brokers.sh stop-all                        stop every node this script started
#   bash .ci/brokers.sh node-name VERSION NAME          its Erlang node name (rd-43-NAME@localhost)
#
# Clusters: members NAME-1..NAME-N are ordinary nodes (kill, start, stop, ctl, logs work
# on each, e.g. `kill 4.3 c-2` then `start 4.3 c-2`: it rejoins with its data).
#   bash .ci/brokers.sh cluster-start VERSION NAME [--nodes N] [--port P] [options]
#                       start N members (default 3) at once, join NAME-2.. to NAME-1
#                       (stop_app, join_cluster, start_app; once), wait until all answer.
#                       Ports P, P+10, P+20... (default: 4.0 -> 5800, 4.3 -> 5850,
#                       host -> 5900); options as for start, given to every member.
#   bash .ci/brokers.sh cluster-urls VERSION NAME        the members' AMQP URLs, one a line
#   bash .ci/brokers.sh cluster-members VERSION NAME     the members' names (NAME-1...)
#   bash .ci/brokers.sh cluster-stop VERSION NAME        graceful stop of every member
#   bash .ci/brokers.sh cluster-rm VERSION NAME          SIGKILL every member, delete the data
#
# VERSION is 4.0 (Debian trixie), 4.3 (Debian sid) or host (the machine's own installed
# rabbitmq-server, run as a scratch node). 4.x nodes run in debootstrapped Debian roots
# under $RD_BROKERS_DIR (default ~/.cache/rabbit-delay/brokers, kept between runs, so
# setup costs 2-3 minutes once per machine), each as a uid of its own.
#
# start options:
#   --port P          AMQP port (default: 4.0 -> 5740, 4.3 -> 5743, host -> 5749 for "main").
#                     Derived: management P+10000, distribution P+20000, CLI P+30000..P+30009.
#   --no-management   don't enable the management plugin (boots faster)
#   --conf LINE       extra rabbitmq.conf line (repeatable), e.g. --conf 'consumer_timeout = 5000'
#   --advanced TERM   an advanced.config entry (repeatable), for settings rabbitmq.conf lacks,
#                     e.g. --advanced '{rabbit, [{dead_letter_worker_publisher_confirm_timeout, 5000}]}'
# Started again without options, a node keeps its port and the options it last started with.
#
# Every node listens on 127.0.0.1 only; guest may log in (from loopback, RabbitMQ's default).
# Each root has its own epmd (4.0: 4400, 4.3: 4403; host nodes share the machine's 4369).
# Nodes of one VERSION share an Erlang cookie, so they can be clustered.
set -euo pipefail

RD_BROKERS_DIR=${RD_BROKERS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rabbit-delay/brokers}
RD_MIRROR=${RD_MIRROR:-http://deb.debian.org/debian}
RD_START_TIMEOUT=${RD_START_TIMEOUT:-120}

say() { printf '[brokers] %s\n' "$*" >&2; }
die() { printf '[brokers] ERROR: %s\n' "$*" >&2; exit 1; }

suite_of() {
    case "$1" in
        4.0) echo trixie ;;
        4.3) echo sid ;;
        host) echo "" ;;
        *) die "unknown version '$1': use 4.0, 4.3 or host" ;;
    esac
}
default_port() {
    case "$1" in 4.0) echo 5740 ;; 4.3) echo 5743 ;; host) echo 5749 ;; esac
}
epmd_port() {
    case "$1" in 4.0) echo 4400 ;; 4.3) echo 4403 ;; host) echo 4369 ;; esac
}
uid_of() {  # the uid the nodes of a root run as (not one the host uses)
    case "$1" in 4.0) echo 2940 ;; 4.3) echo 2943 ;; host) echo 0 ;; esac
}

root_of() {  # the filesystem root of VERSION ("" for host)
    if [ "$1" = host ]; then echo ""; else echo "$RD_BROKERS_DIR/rabbitmq-$1/root"; fi
}
# Where a node keeps its state, as seen from inside its root, and from the host.
node_dir_inside() { echo "/var/lib/rd-nodes/$2"; }
node_dir() {
    if [ "$1" = host ]; then echo "$RD_BROKERS_DIR/host-nodes/$2"; else echo "$(root_of "$1")/var/lib/rd-nodes/$2"; fi
}
node_dir_for_node() {  # the path the node itself uses
    if [ "$1" = host ]; then node_dir "$1" "$2"; else node_dir_inside "$1" "$2"; fi
}

port_open() { timeout 3 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1" 2>/dev/null; }

# -- setup --------------------------------------------------------------------------------

mounted() { mountpoint -q "$1" 2>/dev/null; }

with_lock() {  # with_lock NAME CMD...: one at a time per NAME (nodes start in parallel)
    local name=$1
    shift
    mkdir -p "$RD_BROKERS_DIR"
    (
        flock 8
        "$@"
    ) 8>"$RD_BROKERS_DIR/$name.lock"
}

mount_root() {
    local root=$1
    mounted "$root/proc" || mount -t proc proc "$root/proc"
    mounted "$root/dev" || mount --bind /dev "$root/dev"
}

umount_root() {
    local root=$1
    for m in "$root/dev" "$root/proc"; do
        if mounted "$m"; then umount "$m" 2>/dev/null || umount -l "$m"; fi
    done
}

setup() {
    local version=$1 suite base root
    suite=$(suite_of "$version")
    if [ "$version" = host ]; then
        command -v rabbitmq-server >/dev/null || [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] \
            || die "rabbitmq-server is not installed on this machine (apt-get install rabbitmq-server)"
        return 0
    fi
    base=$RD_BROKERS_DIR/rabbitmq-$version
    root=$base/root
    if [ -f "$base/ready" ]; then
        say "RabbitMQ $version: ready in $root ($(cat "$base/ready"))"
        return 0
    fi
    [ "$(id -u)" = 0 ] || die "setup needs root (debootstrap, chroot, mount)"
    mkdir -p "$RD_BROKERS_DIR"
    exec 9>"$RD_BROKERS_DIR/setup-$version.lock"
    flock 9  # two setups of one version at once: the second waits, then finds it ready
    [ -f "$base/ready" ] && return 0
    # The setups of 4.0 and 4.3 run in parallel: one host apt-get at a time (dpkg's own
    # lock fails the second at once), and apt waits for any other dpkg user.
    (
        flock 8
        if ! command -v debootstrap >/dev/null; then
            say "installing debootstrap"
            DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
                debootstrap >/dev/null
        fi
    ) 8>"$RD_BROKERS_DIR/host-apt.lock" || die "apt-get install debootstrap failed"
    umount_root "$root" 2>/dev/null || true
    rm -rf "$root"
    mkdir -p "$base"
    say "RabbitMQ $version: debootstrap $suite into $root (2-3 minutes, once)"
    debootstrap --variant=minbase "$suite" "$root" "$RD_MIRROR" >"$base/debootstrap.log" 2>&1 \
        || { tail -20 "$base/debootstrap.log" >&2; die "debootstrap $suite failed (log: $base/debootstrap.log)"; }
    # Packages must not start services; the sid Release file may be past its Valid-Until.
    printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
    chmod +x "$root/usr/sbin/policy-rc.d"
    echo 'Acquire::Check-Valid-Until "false";' >"$root/etc/apt/apt.conf.d/99no-valid-until"
    printf '127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
    cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
    mount_root "$root"
    say "RabbitMQ $version: apt-get install rabbitmq-server"
    if ! chroot "$root" /usr/bin/env DEBIAN_FRONTEND=noninteractive LC_ALL=C \
        sh -c 'apt-get update -qq && apt-get install -y -qq --no-install-recommends rabbitmq-server' \
        >"$base/apt.log" 2>&1; then
        umount_root "$root"
        tail -20 "$base/apt.log" >&2
        die "apt-get install rabbitmq-server failed in $root (log: $base/apt.log)"
    fi
    local uid
    uid=$(uid_of "$version")
    chroot "$root" sh -c "getent passwd rdnode >/dev/null || useradd --uid $uid --user-group --home-dir /var/lib/rd-nodes --no-create-home --shell /bin/sh rdnode"
    mkdir -p "$root/var/lib/rd-nodes"
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' | tr a-f A-F | head -c 20 >"$root/var/lib/rd-nodes/cookie"
    chown -R "$uid:$uid" "$root/var/lib/rd-nodes"
    chmod 700 "$root/var/lib/rd-nodes"
    umount_root "$root"
    local installed
    installed=$(chroot "$root" dpkg-query -W -f '${Version}' rabbitmq-server)
    echo "rabbitmq-server $installed ($suite)" >"$base/ready"
    say "RabbitMQ $version: ready ($(cat "$base/ready"))"
}

# -- nodes --------------------------------------------------------------------------------

node_name() { echo "rd-${1//./}-$2@localhost"; }

# The environment a node (and rabbitmqctl for it) runs with; paths as the node sees them.
node_env() {
    local version=$1 name=$2 port=$3 dir
    dir=$(node_dir_for_node "$version" "$name")
    local dist=$((port + 20000)) cli=$((port + 30000))
    printf '%s\n' \
        "HOME=$dir/home" \
        "PATH=/usr/lib/rabbitmq/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
        "LANG=C.UTF-8" "LC_ALL=C.UTF-8" \
        "RABBITMQ_NODENAME=$(node_name "$version" "$name")" \
        "RABBITMQ_NODE_IP_ADDRESS=127.0.0.1" \
        "RABBITMQ_NODE_PORT=$port" \
        "RABBITMQ_DIST_PORT=$dist" \
        "RABBITMQ_CTL_DIST_PORT_MIN=$cli" \
        "RABBITMQ_CTL_DIST_PORT_MAX=$((cli + 9))" \
        "RABBITMQ_MNESIA_BASE=$dir/data" \
        "RABBITMQ_LOG_BASE=$dir/log" \
        "RABBITMQ_ENABLED_PLUGINS_FILE=$dir/enabled_plugins" \
        "RABBITMQ_CONFIG_FILE=$dir/rabbitmq.conf" \
        "RABBITMQ_ADVANCED_CONFIG_FILE=$dir/advanced.config" \
        "RABBITMQ_CONF_ENV_FILE=$dir/rabbitmq-env.conf" \
        "RABBITMQ_PID_FILE=$dir/node.pid" \
        "ERL_EPMD_PORT=$(epmd_port "$version")" \
        "ERL_EPMD_ADDRESS=127.0.0.1" \
        "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=-kernel inet_dist_use_interface {127,0,0,1}" \
        "RABBITMQ_CTL_ERL_ARGS=-kernel inet_dist_use_interface {127,0,0,1}"
}

# run_in VERSION NAME CMD...: run CMD as the node's user in its root, with its environment.
run_in() {
    local version=$1 name=$2
    shift 2
    local port env_args=()
    port=$(cat "$(node_dir "$version" "$name")/port" 2>/dev/null) || die "no node $name of $version (start it first)"
    mapfile -t env_args < <(node_env "$version" "$name" "$port")
    if [ "$version" = host ]; then
        env -i "${env_args[@]}" "$@"
    else
        local uid
        uid=$(uid_of "$version")
        chroot --userspec="$uid:$uid" "$(root_of "$version")" /usr/bin/env -i -C "$(node_dir_inside "$version" "$name")" "${env_args[@]}" "$@"
    fi
}

server_script() {
    if [ "$1" = host ]; then
        # Debian's /usr/sbin/rabbitmq-server re-runs itself through su as `rabbitmq`,
        # which would lose our HOME (and cookie): run the real script behind it.
        if [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ]; then echo /usr/lib/rabbitmq/bin/rabbitmq-server
        else command -v rabbitmq-server; fi
    else
        echo /usr/lib/rabbitmq/bin/rabbitmq-server
    fi
}

answers() {  # answers VERSION NAME: the node accepts AMQP connections
    local port
    port=$(cat "$(node_dir "$1" "$2")/port" 2>/dev/null) || return 1
    port_open "$port" && run_in "$1" "$2" rabbitmqctl -q --timeout 10 status >/dev/null 2>&1
}

node_pid() { cat "$(node_dir "$1" "$2")/node.pid" 2>/dev/null; }
group_pid() { cat "$(node_dir "$1" "$2")/group.pid" 2>/dev/null; }

start() {
    local version=$1 name=${2:-main}
    shift $(($# >= 2 ? 2 : 1))
    local dir
    dir=$(node_dir "$version" "$name")
    # Started again without options (a member after `kill`): as it was started last.
    if [ $# -eq 0 ] && [ -f "$dir/start-options" ]; then
        local saved=()
        mapfile -t saved <"$dir/start-options"
        set -- "${saved[@]}"
    fi
    local options=("$@")
    local port="" management=1 confs=() advanced=()
    while [ $# -gt 0 ]; do
        case "$1" in
            --port) [ $# -ge 2 ] || die "--port needs a port number"; port=$2; shift 2 ;;
            --no-management) management=0; shift ;;
            --conf) [ $# -ge 2 ] || die "--conf needs a rabbitmq.conf line"; confs+=("$2"); shift 2 ;;
            --advanced) [ $# -ge 2 ] || die "--advanced needs an Erlang term"; advanced+=("$2"); shift 2 ;;
            *) die "unknown start option '$1'" ;;
        esac
    done
    setup "$version"
    [ -n "$port" ] || port=$(cat "$dir/port" 2>/dev/null || default_port "$version")
    local root uid
    root=$(root_of "$version")
    uid=$(uid_of "$version")
    if [ -f "$dir/port" ] && [ "$(cat "$dir/port")" = "$port" ] && answers "$version" "$name"; then
        say "node $name of RabbitMQ $version already answers on 127.0.0.1:$port"
        return 0
    fi
    for p in "$port" $((port + 10000)) $((port + 20000)); do
        ! port_open "$p" || die "port $p is taken: choose another --port for node $name"
    done
    [ -z "$root" ] || with_lock "mount-$version" mount_root "$root"
    mkdir -p "$dir/home" "$dir/data" "$dir/log"
    echo "$port" >"$dir/port"
    if [ ${#options[@]} -gt 0 ]; then printf '%s\n' "${options[@]}" >"$dir/start-options"
    else : >"$dir/start-options"; fi
    local cookie=$dir/home/.erlang.cookie
    if [ ! -f "$cookie" ]; then
        if [ -n "$root" ]; then cp "$root/var/lib/rd-nodes/cookie" "$cookie"
        else
            [ -f "$RD_BROKERS_DIR/host-nodes/cookie" ] || head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' | tr a-f A-F | head -c 20 >"$RD_BROKERS_DIR/host-nodes/cookie"
            cp "$RD_BROKERS_DIR/host-nodes/cookie" "$cookie"
        fi
        chmod 400 "$cookie"
    fi
    if [ "$management" = 1 ]; then echo '[rabbitmq_management].' >"$dir/enabled_plugins"
    else echo '[].' >"$dir/enabled_plugins"; fi
    {
        echo "listeners.tcp.1 = 127.0.0.1:$port"
        echo "management.tcp.ip = 127.0.0.1"
        echo "management.tcp.port = $((port + 10000))"
        echo "disk_free_limit.absolute = 50MB"
        echo "log.file.level = info"
        for line in "${confs[@]}"; do echo "$line"; done
    } >"$dir/rabbitmq.conf"
    : >"$dir/rabbitmq-env.conf"
    if [ ${#advanced[@]} -gt 0 ]; then
        local joined
        joined=$(printf '%s,\n' "${advanced[@]}")
        printf '[\n%s\n].\n' "${joined%,}" >"$dir/advanced.config"
    elif [ ! -f "$dir/advanced.config" ] || [ -f "$dir/advanced.from-options" ]; then
        echo '[].' >"$dir/advanced.config"
    fi
    if [ ${#advanced[@]} -gt 0 ]; then : >"$dir/advanced.from-options"; else rm -f "$dir/advanced.from-options"; fi
    rm -f "$dir/node.pid"
    chown -R "$uid:$uid" "$dir"
    local starts
    starts=$(find "$dir" -maxdepth 1 -name "stdout.*.log" | wc -l)
    say "starting node $name of RabbitMQ $version on 127.0.0.1:$port"
    # A session of its own: `kill` takes down exactly this node (script and VM).
    setsid bash -c "$(declare -f run_in node_env node_dir node_dir_for_node node_dir_inside root_of uid_of epmd_port node_name die); RD_BROKERS_DIR='$RD_BROKERS_DIR'; run_in '$version' '$name' $(server_script "$version")" \
        </dev/null >"$dir/stdout.$((starts + 1)).log" 2>&1 &
    echo $! >"$dir/group.pid"
    local deadline=$((SECONDS + RD_START_TIMEOUT))
    until port_open "$port"; do
        if ! kill -0 "$(group_pid "$version" "$name")" 2>/dev/null; then
            tail -30 "$dir/stdout.$((starts + 1)).log" >&2
            die "node $name of RabbitMQ $version exited while booting (logs: $dir/log)"
        fi
        ((SECONDS < deadline)) || { kill_node "$version" "$name"; die "node $name of RabbitMQ $version did not start within ${RD_START_TIMEOUT}s (logs: $dir/log)"; }
        sleep 0.3
    done
    run_in "$version" "$name" rabbitmqctl -q await_startup --timeout "$RD_START_TIMEOUT" >/dev/null
    if [ "$management" = 1 ]; then
        until timeout 3 bash -c "exec 3<>/dev/tcp/127.0.0.1/$((port + 10000))" 2>/dev/null; do
            ((SECONDS < deadline)) || die "management API of node $name did not answer within ${RD_START_TIMEOUT}s"
            sleep 0.3
        done
    fi
    say "node $name of RabbitMQ $version is up: $(url "$version" "$name")"
}

kill_node() {
    local version=$1 name=$2 pid gpid
    pid=$(node_pid "$version" "$name" || true)
    gpid=$(group_pid "$version" "$name" || true)
    [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null || true
    [ -n "$gpid" ] && kill -9 -- "-$gpid" 2>/dev/null || true
    # The VM may have been started under another process group: its pid file names it.
    local deadline=$((SECONDS + 15))
    while [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
    while [ -n "$gpid" ] && kill -0 "$gpid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
}

stop() {
    local version=$1 name=${2:-main} pid
    [ -f "$(node_dir "$version" "$name")/port" ] || return 0
    pid=$(node_pid "$version" "$name" || true)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        say "stopping node $name of RabbitMQ $version"
        run_in "$version" "$name" rabbitmqctl -q --timeout 45 stop >/dev/null 2>&1 || true
        local deadline=$((SECONDS + 45))
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    fi
    kill_node "$version" "$name"
    with_lock "mount-$version" maybe_umount "$version"
}

maybe_umount() {  # unmount /proc and /dev of a root when none of its nodes runs
    local version=$1 root dir
    root=$(root_of "$version")
    [ -n "$root" ] || return 0
    for dir in "$root"/var/lib/rd-nodes/*/; do
        [ -f "$dir/node.pid" ] && kill -0 "$(cat "$dir/node.pid")" 2>/dev/null && return 0
    done
    # epmd of this root is started by the first node and outlives the last one.
    pkill -9 -f "epmd.*-port $(epmd_port "$version")" 2>/dev/null || true
    for pid in $(pgrep -f "epmd" 2>/dev/null); do
        [ "$(readlink "/proc/$pid/root" 2>/dev/null)" = "$root" ] && kill -9 "$pid" 2>/dev/null
    done
    sleep 0.2
    umount_root "$root"
}

log_file() {  # log_file VERSION [NAME]: the node's main log file (as the host sees it)
    echo "$(node_dir "$1" "${2:-main}")/log/$(node_name "$1" "${2:-main}").log"
}

logs() {  # logs VERSION NAME [LINES]: the end of the node's logs
    local dir f
    dir=$(node_dir "$1" "$2")
    for f in "$dir"/stdout.*.log "$dir"/log/*.log; do
        [ -f "$f" ] || continue
        echo "--- $f"
        tail -n "${3:-30}" "$f"
    done
}

rm_node() {  # no graceful stop: the data goes too (a graceful stop of a loaded node took 40 s)
    local version=$1 name=$2
    kill_and_rm "$version" "$name"
    with_lock "mount-$version" maybe_umount "$version"
}

version() {  # the RabbitMQ version VERSION installs
    if [ "$1" = host ]; then
        local d
        for d in /usr/lib/rabbitmq/lib/rabbitmq_server-*; do [ -d "$d" ] && echo "${d##*-}" && return 0; done
        die "rabbitmq-server is not installed on this machine"
    fi
    setup "$1" 2>/dev/null
    chroot "$(root_of "$1")" dpkg-query -W -f '${Version}\n' rabbitmq-server | sed 's/-.*//'
}

url() { echo "amqp://guest:guest@127.0.0.1:$(cat "$(node_dir "$1" "${2:-main}")/port" 2>/dev/null || default_port "$1")/%2F"; }
management_url() { echo "http://127.0.0.1:$(( $(cat "$(node_dir "$1" "${2:-main}")/port" 2>/dev/null || default_port "$1") + 10000 ))"; }

list() {
    local version dir name
    for version in 4.0 4.3 host; do
        for dir in "$(dirname "$(node_dir "$version" x)")"/*/; do
            [ -f "$dir/port" ] || continue
            name=$(basename "$dir")
            if answers "$version" "$name"; then echo "$version $name $(url "$version" "$name") up"
            else echo "$version $name $(url "$version" "$name") down"; fi
        done
    done
}

stop_all() {
    local version dir
    for version in 4.0 4.3 host; do
        for dir in "$(dirname "$(node_dir "$version" x)")"/*/; do
            [ -f "$dir/port" ] && stop "$version" "$(basename "$dir")"
        done
    done
    return 0
}

# -- clusters -----------------------------------------------------------------------------

cluster_default_port() {
    case "$1" in 4.0) echo 5800 ;; 4.3) echo 5850 ;; host) echo 5900 ;; esac
}

cluster_members() {  # cluster_members VERSION NAME: NAME-1, NAME-2... (those that exist)
    local version=$1 name=$2 dir n
    [ -n "$name" ] || die "name the cluster"
    for dir in "$(dirname "$(node_dir "$version" x)")/$name"-*/; do
        [ -f "$dir/port" ] || continue
        n=$(basename "$dir")
        n=${n#"$name"-}
        [[ "$n" =~ ^[0-9]+$ ]] && echo "$n"
    done | sort -n | sed "s/^/$name-/"
}

cluster_start() {
    local version=${1:-} name=${2:-}
    [ -n "$version" ] && [ -n "$name" ] || die "usage: cluster-start VERSION NAME [--nodes N] [--port P] [start options]"
    shift 2
    local nodes=3 port="" options=()
    while [ $# -gt 0 ]; do
        case "$1" in
            --nodes) [ $# -ge 2 ] || die "--nodes needs a number"; nodes=$2; shift 2 ;;
            --port) [ $# -ge 2 ] || die "--port needs a port number"; port=$2; shift 2 ;;
            --conf | --advanced) [ $# -ge 2 ] || die "$1 needs a value"; options+=("$1" "$2"); shift 2 ;;
            --no-management) options+=("$1"); shift ;;
            *) die "unknown cluster-start option '$1'" ;;
        esac
    done
    [[ "$nodes" =~ ^[1-9][0-9]?$ ]] || die "--nodes takes a number from 1 to 99, not '$nodes'"
    setup "$version"  # once, before the members start in parallel
    [ -n "$port" ] || port=$(cluster_default_port "$version")
    local started=$SECONDS i member member_port pids=() failed=0
    for ((i = 1; i <= nodes; i++)); do
        member="$name-$i"
        if [ -f "$(node_dir "$version" "$member")/port" ] && [ ${#options[@]} -eq 0 ]; then
            start "$version" "$member" &  # started before: its port and options, its data
        else
            member_port=$(cat "$(node_dir "$version" "$member")/port" 2>/dev/null || echo $((port + (i - 1) * 10)))
            start "$version" "$member" --port "$member_port" "${options[@]}" &
        fi
        pids+=($!)
    done
    for i in "${pids[@]}"; do wait "$i" || failed=1; done
    ((failed == 0)) || die "cluster $name of RabbitMQ $version: a member did not start (above); remove it with: cluster-rm $version $name"
    say "cluster $name of RabbitMQ $version: $nodes members booted in $((SECONDS - started))s"
    local seed joining=()
    seed=$(node_name "$version" "$name-1")
    for ((i = 2; i <= nodes; i++)); do
        member="$name-$i"
        [ "$(cat "$(node_dir "$version" "$member")/joined" 2>/dev/null)" = "$seed" ] || joining+=("$member")
    done
    if [ ${#joining[@]} -gt 0 ]; then
        # stop_app and start_app (the slow part: the app and its plugins) at once on every
        # member; the joins themselves one at a time, each a change of the seed's schema.
        pids=()
        for member in "${joining[@]}"; do
            run_in "$version" "$member" rabbitmqctl -q --timeout 60 stop_app >/dev/null &
            pids+=($!)
        done
        for i in "${pids[@]}"; do wait "$i" || failed=1; done
        ((failed == 0)) || die "cluster $name of RabbitMQ $version: stop_app failed on a member"
        for member in "${joining[@]}"; do
            say "joining $member to $seed"
            run_in "$version" "$member" rabbitmqctl -q --timeout 60 join_cluster "$seed" >/dev/null \
                || die "$member could not join $seed (logs: $(node_dir "$version" "$member")/log)"
            echo "$seed" >"$(node_dir "$version" "$member")/joined"
        done
        pids=()
        for member in "${joining[@]}"; do
            run_in "$version" "$member" rabbitmqctl -q --timeout 120 start_app >/dev/null &
            pids+=($!)
        done
        for i in "${pids[@]}"; do wait "$i" || failed=1; done
        ((failed == 0)) || die "cluster $name of RabbitMQ $version: start_app failed on a member (logs: ctl/logs)"
    fi
    # Each member answers and each join succeeded: one cluster (`ctl VERSION NAME-1
    # cluster_status` shows it; a CLI call costs 1-2 s, so it is not repeated here).
    say "cluster $name of RabbitMQ $version is up ($nodes members, $((SECONDS - started))s): $(cluster_urls "$version" "$name" | tr '\n' ' ')"
}

cluster_urls() {
    local member
    for member in $(cluster_members "$1" "$2"); do url "$1" "$member"; done
}

cluster_each() {  # cluster_each VERB VERSION NAME: VERB on every member at once
    local verb=$1 version=$2 name=$3 member pids=() failed=0 pid
    for member in $(cluster_members "$version" "$name"); do
        "$verb" "$version" "$member" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    return "$failed"
}

kill_and_rm() { kill_node "$1" "$2"; rm -rf "$(node_dir "$1" "$2")"; }

cluster_stop() { cluster_each stop "$1" "$2"; }

cluster_rm() {  # no graceful stop: the data goes too
    cluster_each kill_and_rm "$1" "$2"
    with_lock "mount-$1" maybe_umount "$1"
}

mkdir -p "$RD_BROKERS_DIR/host-nodes"
verb=${1:-}
[ -n "$verb" ] || { sed -n '2,/^set -euo/{/^set -euo/d;p}' "$0"; exit 2; }
shift
case "$verb" in
    setup) for v in "$@"; do setup "$v"; done ;;
    start) start "$@" ;;
    stop) stop "$@" ;;
    kill) kill_node "$@" ;;
    rm) rm_node "$@" ;;
    url) url "$@" ;;
    version) version "$@" ;;
    logs) logs "$@" ;;
    log-file) log_file "$@" ;;
    management-url) management_url "$@" ;;
    ctl) v=$1 n=$2; shift 2; run_in "$v" "$n" rabbitmqctl "$@" ;;
    list) list ;;
    stop-all) stop_all ;;
    node-name) node_name "$@" ;;
    cluster-start) cluster_start "$@" ;;
    cluster-urls) cluster_urls "$@" ;;
    cluster-members) cluster_members "$@" ;;
    cluster-stop) cluster_stop "$@" ;;
    cluster-rm) cluster_rm "$@" ;;
    *) die "unknown verb '$verb' (setup, start, stop, kill, url, management-url, ctl, rm, list, stop-all, node-name, cluster-start, cluster-urls, cluster-members, cluster-stop, cluster-rm)" ;;
esac
