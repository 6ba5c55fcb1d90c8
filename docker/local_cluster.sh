#!/usr/bin/env bash
# A real multi-node Slurm 22.05 cluster on one machine (munge, MariaDB, slurmdbd, slurmctld, and
# one slurmd per compute node) plus a key-only sshd on 127.0.0.1, so the DAGs can be run against
# a real scheduler, with real node failures and multi-node jobs, on one machine.
#
#   local_cluster.sh up | down | status | env | sync-env        (as root)
#   PP_CLUSTER_NODES=N (default 3) compute nodes node1..nodeN, in partitions debug and gpu
#   PP_CLUSTER_FAULT_NODES=M (default 3) more nodes after them, in partition faults only: the
#     test suite's node-failure stories set them down and cut their links, which no other
#     job sees (no campaign names that partition), so those stories run beside the rest
#
# Each compute node is a network namespace (/run/netns/nodeI, address $NET.1I, a veth to the bridge
# $BRIDGE at $NET.1) plus a UTS namespace (its host name) and a mount namespace (its /etc/hosts);
# the filesystem, PIDs and users stay shared, so jobs see the same files as the sshd and the Airflow
# workers, which stay in the root namespace with slurmctld, slurmdbd, MariaDB and munge.
# Needs CAP_SYS_ADMIN and CAP_NET_ADMIN.
#
# No systemd and no cgroups: every daemon runs in the foreground in its own session and the PID we
# started is recorded under $STATE/pids, so `down` stops exactly what `up` started and nothing else.
set -euo pipefail
shopt -u patsub_replacement 2>/dev/null || true  # render: an & in a value stays an &

STATE=${PP_CLUSTER_STATE:-/var/lib/pretrain-cluster}
SSH_PORT=${PP_SSH_PORT:-2222}
SSH_HOST=${PP_SSH_HOST:-127.0.0.1}      # the address Airflow dials (another one from a container)
# shellcheck disable=SC2034  # SSH_LISTEN and MEM_MB are read by render through ${!name}
SSH_LISTEN=${PP_SSH_LISTEN:-127.0.0.1}  # the container image sets 0.0.0.0 so a port can be published
DB_PORT=${PP_DB_PORT:-3307}             # not 3306: a distro MariaDB on the same machine must not clash
CLUSTER=pp-local
CLUSTER_USER=pretrain
USER_HOME=/home/$CLUSTER_USER
REMOTE_WORK_DIR=$USER_HOME/pp-runs
JOB_VENV=/opt/pretrain-pipeline/venv
# The project's installed versions, one directory per content hash; the job venv's .pth names
# the current one (install_project).
PROJECT_VERSIONS=/opt/pretrain-pipeline/project
PROJECT_PTH=pretrain_pipeline_current.pth
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The controller's host name: slurmctld and slurmdbd check that SlurmctldHost/DbdHost name them.
CTLD_HOST=$(hostname -s)
NODES=${PP_CLUSTER_NODES:-3}
[[ $NODES =~ ^[1-9]$ ]] || { echo "PP_CLUSTER_NODES must be 1-9, not '$NODES'" >&2; exit 2; }
FAULT_NODES=${PP_CLUSTER_FAULT_NODES:-3}
[[ $FAULT_NODES =~ ^[0-9]$ ]] && ((NODES + FAULT_NODES <= 9)) ||
  { echo "PP_CLUSTER_FAULT_NODES must be 0-$((9 - NODES)), not '$FAULT_NODES'" >&2; exit 2; }
NET=${PP_CLUSTER_NET:-10.77.0}          # a private /24: the bridge is .1, nodeI is .1I
[[ $NET =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "PP_CLUSTER_NET must be A.B.C, not '$NET'" >&2; exit 2; }
BRIDGE=pp-br0
BRIDGE_ADDR=$NET.1
NODE_NAMES=()
for ((i = 1; i <= NODES + FAULT_NODES; i++)); do NODE_NAMES+=("node$i"); done
# A Slurm host list of nodes FIRST..LAST.
host_range() { if (($1 == $2)); then echo "node$1"; else echo "node[$1-$2]"; fi; }
# shellcheck disable=SC2034  # NODELIST and FAULT_PARTITION are read by render through ${!name}
NODELIST=$(host_range 1 "$NODES")
# shellcheck disable=SC2034  # every node, the fault partition's included (gres.conf)
ALL_NODES=$(host_range 1 $((NODES + FAULT_NODES)))
FAULT_PARTITION=
# shellcheck disable=SC2034
((FAULT_NODES == 0)) || FAULT_PARTITION="PartitionName=faults Nodes=$(
  host_range $((NODES + 1)) $((NODES + FAULT_NODES))) MaxTime=INFINITE State=UP"
DB_SOCKET=$STATE/mysqld/mysqld.sock
HOST_KEY=$STATE/ssh/ssh_host_ed25519_key
CLIENT_KEY=$STATE/id_ed25519
# python3 is Debian's 3.11, the interpreter of the jobs' venv.
PACKAGES=(slurm-wlm slurmdbd mariadb-server munge openssh-server python3)
# Start order; `down` walks it backwards. slurmd-NODE is node NODE's slurmd (binary slurmd).
DAEMONS=(munged mariadbd slurmdbd slurmctld)
for n in "${NODE_NAMES[@]}"; do DAEMONS+=("slurmd-$n"); done
DAEMONS+=(sshd)

log() { printf '[local_cluster] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# --- daemon bookkeeping -------------------------------------------------------------------------

# Prints the recorded PID if it is alive AND still runs the daemon's binary: a recycled PID that
# now belongs to something else must never be reported as ours, let alone killed. (Debian's
# /usr/sbin/slurm* are alternatives symlinks, hence readlink -f.) The binary of slurmd-node1 is
# slurmd: the name up to the first '-'.
running_pid() {
  local pid
  pid=$(cat "$STATE/pids/$1.pid" 2>/dev/null) || return 1
  [[ $(readlink "/proc/$pid/exe" 2>/dev/null) == "$(readlink -f "/usr/sbin/${1%%-*}")" ]] ||
    return 1
  echo "$pid"
}

# setsid gives the daemon its own session (it outlives this shell and the caller's terminal);
# as we are not a process-group leader it execs in place, so $! is the daemon's own PID.
# Its stdout/stderr is its log: Slurm daemons under -D log to stderr (a LogFile too would
# duplicate every line), and early fatal errors land there whatever the daemon.
# Every descriptor above 2 is closed for the daemon: one inherited from a caller's
# `flock -x /tmp/pp-cluster.lock ... up` would hold that lock for as long as the daemon lives
# (it happened: munged, mariadbd and slurmdbd held the tests' cluster lock, and every test waited).
close_inherited_fds() {
  local fd
  for fd in $(ls "/proc/$BASHPID/fd"); do ((fd > 2)) && eval "exec $fd>&-"; done; return 0
}

start_daemon() {
  local name=$1 pid; shift
  if pid=$(running_pid "$name"); then log "$name already running (pid $pid)"; return 0; fi
  # The subshell execs setsid, which execs the daemon in place: $! is the daemon's PID.
  (close_inherited_fds; exec setsid "$@") >>"$STATE/log/$name.log" 2>&1 </dev/null &
  pid=$!
  echo "$pid" >"$STATE/pids/$name.pid"
  # Until the chain of execs (subshell, setsid, nsenter, ...) reaches the daemon, running_pid
  # would take the PID for someone else's: wait for it, or for the PID to be gone.
  for _ in $(seq 100); do
    running_pid "$name" >/dev/null || [[ ! -e /proc/$pid ]] && break
    sleep 0.05
  done
  log "$name started (pid $pid)"
}

stop_daemon() {
  local name=$1 pid
  if ! pid=$(running_pid "$name"); then rm -f "$STATE/pids/$name.pid"; return 0; fi
  kill -TERM "$pid" 2>/dev/null || true  # it may have exited since running_pid looked
  for _ in $(seq 50); do running_pid "$name" >/dev/null || break; sleep 0.2; done
  if running_pid "$name" >/dev/null; then log "$name ignored SIGTERM; killing"; kill -KILL "$pid"; fi
  rm -f "$STATE/pids/$name.pid"
  log "$name stopped (pid $pid)"
}

# Polls CHECK... until it succeeds; fails fast, with the log, if the daemon dies or time runs out.
wait_for() {
  local name=$1 timeout=$2 deadline=$((SECONDS + $2)); shift 2
  until "$@" >/dev/null 2>&1; do
    running_pid "$name" >/dev/null || fail_with_log "$name exited during start-up" "$name"
    ((SECONDS < deadline)) || fail_with_log "$name not ready after ${timeout}s" "$name"
    sleep 0.2
  done
}

fail_with_log() {
  tail -n 25 "$STATE/log/$2.log" >&2 || true
  die "$1; full log: $STATE/log/$2.log"
}

# Writes stdin to PATH with MODE and OWNER, replacing the file only when the content differs so a
# second `up` changes nothing; warns when the running DAEMON that reads it has not seen a change.
# Runs at the end of a pipeline (a subshell), so it reports instead of recording.
write_file() {
  local path=$1 mode=$2 owner=$3 daemon=${4:-} tmp
  tmp=$(mktemp "$path.XXXXXX")
  cat >"$tmp"
  [[ -s $tmp ]] || { rm -f "$tmp"; die "refusing to write an empty $path"; }
  chmod "$mode" "$tmp"
  chown "$owner" "$tmp"
  if cmp -s "$tmp" "$path"; then rm -f "$tmp"; return 0; fi
  mv -f "$tmp" "$path"
  if [[ -n $daemon ]] && running_pid "$daemon" >/dev/null; then
    log "WARNING: $path changed under the running $daemon: run 'down' then 'up' to apply it"
  fi
}

# Prints a template from docker/slurm/ with each @NAME@ replaced by the shell variable NAME
# (NODE_LINES spans several lines, hence no sed).
render() {
  local v out
  out=$(<"$REPO_ROOT/docker/slurm/$1")
  for v in CLUSTER CTLD_HOST BRIDGE_ADDR NODELIST ALL_NODES FAULT_PARTITION NODE_LINES STATE \
    MEM_MB DB_PORT DB_PASS SSH_LISTEN SSH_PORT HOST_KEY CLUSTER_USER; do
    out=${out//@$v@/${!v}}
  done
  [[ ! $out =~ @[A-Z_]+@ ]] || die "unfilled placeholder ${BASH_REMATCH[0]} in $1"
  printf '%s\n' "$out"
}

# --- machine setup ------------------------------------------------------------------------------

ensure_packages() {
  local missing=() p rc=0
  command -v uv >/dev/null || PACKAGES+=(python3-pip)  # sync-env installs uv with it
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  log "installing ${missing[*]}"
  # Keep maintainer scripts from starting the distro's own services: this script owns the daemons.
  local policy=/usr/sbin/policy-rc.d ours=
  [[ -e $policy ]] || { printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod 755 "$policy"; ours=1; }
  { apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  } || rc=$?
  [[ -z $ours ]] || rm -f "$policy"
  return "$rc"
}

prepare_dirs() {
  install -d -m 755 "$STATE" "$STATE/pids" "$STATE/log" "$STATE/run" "$STATE/slurmd" /run/sshd
  local n
  for n in "${NODE_NAMES[@]}"; do install -d -m 755 "$STATE/slurmd/$n"; done
  install -d -m 700 "$STATE/ssh"
  install -d -o slurm -g slurm -m 700 "$STATE/slurmctld"
  install -d -o mysql -g mysql -m 755 "$STATE/mysqld"
  install -d -o munge -g munge -m 755 /run/munge
  # gres.conf's GPUs: placeholders, not devices (a gpu GRES without File= is dropped by slurmd).
  install -d -m 755 "$STATE/fake-gpu"
  touch "$STATE/fake-gpu/nvidia"{0..3}
}

ensure_user() {
  id -u "$CLUSTER_USER" >/dev/null 2>&1 || useradd -m -d "$USER_HOME" -s /bin/bash "$CLUSTER_USER"
  # useradd leaves the account locked ('!'); with UsePAM no, sshd then refuses even key logins.
  [[ $(getent shadow "$CLUSTER_USER" | cut -d: -f2) == '*' ]] || usermod -p '*' "$CLUSTER_USER"
  # A home on a fresh container volume is root's; sbatch writes slurm-<id>.out into it.
  install -d -o "$CLUSTER_USER" -g "$CLUSTER_USER" -m 755 "$USER_HOME"
  install -d -o "$CLUSTER_USER" -g "$CLUSTER_USER" -m 700 "$USER_HOME/.ssh"
  install -d -o "$CLUSTER_USER" -g "$CLUSTER_USER" -m 755 "$REMOTE_WORK_DIR"
}

# --- the compute nodes' network ----------------------------------------------------------------

node_addr() { echo "$NET.$((10 + $1))"; }

# The bridge in the root namespace; slurmctld and slurmdbd listen on every address, its included,
# and the nodes reach them (and the sshd's machine) through it.
ensure_bridge() {
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge
    log "bridge $BRIDGE created"
  fi
  ip -br addr show dev "$BRIDGE" | grep -q " $BRIDGE_ADDR/24" ||
    ip addr add "$BRIDGE_ADDR/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
}

# nodeI: a network namespace with lo and eth0 ($NET.1I), whose veth peer pp-vethI is on the bridge.
ensure_node_net() {
  local n=$1 i=$2 veth=pp-veth$2 addr
  addr=$(node_addr "$i")
  # Listed before it exists, so that `down` also removes what an interrupted `up` left.
  grep -qx "$n" "$STATE/netns" 2>/dev/null || echo "$n" >>"$STATE/netns"
  [[ -e /run/netns/$n ]] || { ip netns add "$n"; log "network namespace $n created"; }
  ip -n "$n" link set lo up
  if ! ip -n "$n" link show eth0 >/dev/null 2>&1; then
    # A veth of that name whose peer is not here belongs to a namespace an earlier `down`
    # removed while a job's process still held it: replace it.
    ip link del "$veth" 2>/dev/null || true
    ip link add "$veth" type veth peer name eth0 netns "$n"
  fi
  ip link set "$veth" master "$BRIDGE" up
  ip -n "$n" -br addr show dev eth0 | grep -q " $addr/24" || ip -n "$n" addr add "$addr/24" dev eth0
  ip -n "$n" link set eth0 up
  ip -n "$n" route replace default via "$BRIDGE_ADDR"
}

# Node names resolve inside the nodes only (this file is bound over their /etc/hosts); the root
# namespace keeps its own /etc/hosts, so tools there use the nodes' addresses.
write_node_hosts() {
  local n i=0
  { echo "127.0.0.1 localhost"; echo "$BRIDGE_ADDR $CTLD_HOST"
    for n in "${NODE_NAMES[@]}"; do i=$((i + 1)); echo "$(node_addr "$i") $n"; done
  } | write_file "$STATE/hosts" 644 root:
}

# Every namespace and veth `up` made (listed in $STATE/netns), and the bridge. Only once no
# slurmd of ours runs: a job's processes left in a namespace keep it alive as long as they live.
remove_node_nets() {
  local n
  if [[ -f $STATE/netns ]]; then
    while read -r n; do
      [[ -n $n ]] || continue
      # Deleting the veth takes its peer along even when a process keeps the namespace alive.
      ip link del "pp-veth${n#node}" 2>/dev/null || true
      ip netns del "$n" 2>/dev/null && log "network namespace $n removed"
    done <"$STATE/netns"
    rm -f "$STATE/netns"
  fi
  ip link show "$BRIDGE" >/dev/null 2>&1 && ip link del "$BRIDGE" && log "bridge $BRIDGE removed"
  return 0
}

# The node's slurmd: in its network namespace (nsenter), with its own host name (UTS) and
# /etc/hosts (a mount namespace whose mounts stay its own: propagation slave). Not `ip netns
# exec`: that remounts /sys, and slurmd cannot find /sys/fs/cgroup. Every step execs, so the
# recorded PID is slurmd's.
start_slurmd() {
  local n=$1
  start_daemon "slurmd-$n" nsenter --net="/run/netns/$n" unshare --uts --mount --propagation slave \
    bash -c 'hostname "$1" && mount --bind "$2" /etc/hosts && exec "${@:3}"' node-init \
    "$n" "$STATE/hosts" /usr/sbin/slurmd -D -N "$n"
}

# --- daemons, in start order --------------------------------------------------------------------

start_munge() {
  local key=/etc/munge/munge.key
  if [[ ! -s $key ]]; then log "generating $key"; mungekey --create --keyfile="$key"; fi
  chown munge: "$key"
  chmod 400 "$key"
  # setpriv execs (unlike runuser, which stays as a parent), so the recorded PID is munged's.
  start_daemon munged setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged --foreground
  wait_for munged 15 bash -c 'munge -n | unmunge'
}

start_mariadb() {
  local datadir=$STATE/mysql
  if [[ ! -d $datadir/mysql ]]; then
    log "initialising MariaDB in $datadir"
    mariadb-install-db --no-defaults --user=mysql --datadir="$datadir" --skip-test-db \
      --auth-root-authentication-method=socket >>"$STATE/log/mariadbd.log" 2>&1 ||
      fail_with_log "mariadb-install-db failed" mariadbd
  fi
  # --no-defaults: Debian's /etc/mysql config would point it at the system datadir and socket.
  start_daemon mariadbd /usr/sbin/mariadbd --no-defaults --user=mysql --bind-address=127.0.0.1 \
    --port="$DB_PORT" --datadir="$datadir" --socket="$DB_SOCKET" \
    --pid-file="$STATE/mysqld/mariadbd.pid" --skip-name-resolve \
    --innodb-lock-wait-timeout=900  # slurmdbd's advice; its buffer-pool advice (GBs) is not needed here
  wait_for mariadbd 30 mariadb-admin --no-defaults --socket="$DB_SOCKET" ping
  mariadb --no-defaults --socket="$DB_SOCKET" -u root <<SQL
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
SQL
}

write_slurm_configs() {
  [[ -s $STATE/db.pass ]] || (umask 077 && od -An -N16 -tx1 /dev/urandom | tr -d ' \n' >"$STATE/db.pass")
  DB_PASS=$(cat "$STATE/db.pass")
  # shellcheck disable=SC2034
  MEM_MB=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
  local n i=0
  # shellcheck disable=SC2034
  NODE_LINES=$(for n in "${NODE_NAMES[@]}"; do
    i=$((i + 1))
    echo "NodeName=$n NodeHostName=$n NodeAddr=$(node_addr "$i") CPUs=32 RealMemory=$MEM_MB Gres=gpu:4 State=UNKNOWN"
  done)
  install -d -m 755 /etc/slurm
  render slurmdbd.conf.in | write_file /etc/slurm/slurmdbd.conf 600 slurm: slurmdbd
  render slurm.conf.in | write_file /etc/slurm/slurm.conf 644 root: slurmctld
  render gres.conf.in | write_file /etc/slurm/gres.conf 644 root: slurmd
}

# slurmctld must find its cluster in slurmdbd when it starts; the account gives jobs an association.
register_cluster() {
  wait_for slurmdbd 30 sacctmgr -n show cluster
  sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER"
  sacctmgr -n -P show account "$CLUSTER_USER" format=account | grep -q . ||
    sacctmgr -i add account "$CLUSTER_USER" cluster="$CLUSTER" description=pipeline organization=local
  sacctmgr -n -P show user "$CLUSTER_USER" format=user | grep -q . ||
    sacctmgr -i add user "$CLUSTER_USER" account="$CLUSTER_USER" cluster="$CLUSTER"
}

ctld_up() { scontrol ping | grep -q 'is UP'; }

# A node left DOWN or DRAINED by an unclean stop (or a test) is resumed; ReturnToService=1
# covers a node that was only unreachable.
node_ready() {
  local state
  # One line per partition the node is in (debug and gpu): the same state on each.
  state=$(sinfo -h -N -n "$1" -o %t | sort -u)
  [[ $state == *drain* || $state == down ]] && scontrol update nodename="$1" state=resume
  # plnd: idle but reserved by the backfill planner for a pending job (a healthy node).
  [[ $state =~ ^(idle|mix|alloc|comp|plnd)$ ]]
}

start_sshd() {
  [[ -s $HOST_KEY ]] || ssh-keygen -q -t ed25519 -N '' -C '' -f "$HOST_KEY"
  [[ -s $CLIENT_KEY ]] || ssh-keygen -q -t ed25519 -N '' -C "airflow@$CLUSTER" -f "$CLIENT_KEY"
  chmod 600 "$CLIENT_KEY"
  # Our key replaces any earlier one of ours (a wiped state dir makes a new one); others stay.
  local auth=$USER_HOME/.ssh/authorized_keys
  { grep -v " airflow@$CLUSTER\$" "$auth" 2>/dev/null || true; cat "$CLIENT_KEY.pub"; } |
    write_file "$auth" 600 "$CLUSTER_USER:"
  render sshd_config.in | write_file "$STATE/ssh/sshd_config" 600 root: sshd
  /usr/sbin/sshd -t -f "$STATE/ssh/sshd_config"
  start_daemon sshd /usr/sbin/sshd -D -e -f "$STATE/ssh/sshd_config"
  wait_for sshd 10 bash -c ": </dev/tcp/${SSH_LISTEN/0.0.0.0/127.0.0.1}/$SSH_PORT"
}

# Host key checking stays on: the connection pins this sshd's own host key.
write_airflow_env() {
  local host_key json
  host_key=$(cut -d' ' -f1,2 "$HOST_KEY.pub")
  echo "[$SSH_HOST]:$SSH_PORT $host_key" | write_file "$STATE/known_hosts" 644 root:
  json=$(printf '{"conn_type":"ssh","host":"%s","port":%s,"login":"%s","extra":{"key_file":"%s","host_key":"%s","no_host_key_check":false,"remote_work_dir":"%s","remote_python":"%s","keepalive_interval":15}}' \
    "$SSH_HOST" "$SSH_PORT" "$CLUSTER_USER" "$CLIENT_KEY" "$host_key" "$REMOTE_WORK_DIR" "$JOB_VENV/bin/python")
  echo "export AIRFLOW_CONN_SLURM_LOCAL='$json'" | write_file "$STATE/airflow.env" 644 root:
}

# --- the jobs' Python environment ---------------------------------------------------------------

# /root is mode 700, so jobs (run as $CLUSTER_USER) need their own venv on Debian's python3.11.
cmd_sync_env() {
  command -v uv >/dev/null || /usr/bin/python3 -m pip install --quiet --break-system-packages uv
  local py=$JOB_VENV/bin/python lock=$REPO_ROOT/requirements.lock sum links=()
  [[ -d /opt/wheels ]] && links=(--find-links /opt/wheels)  # local CPU torch wheel, when present
  [[ -x $py ]] || uv venv --quiet --python /usr/bin/python3.11 "$JOB_VENV"
  sum=$(sha256sum "$lock" | cut -d' ' -f1)
  if [[ $(cat "$JOB_VENV/.lock.sha256" 2>/dev/null) != "$sum" ]]; then
    log "installing requirements.lock into $JOB_VENV"
    uv pip install --quiet --python "$py" "${links[@]}" -r "$lock"
    echo "$sum" >"$JOB_VENV/.lock.sha256"
  fi
  install_vllm "$py" "${links[@]}"
  install_project "$py"
  bash "$REPO_ROOT/docker/bridge_venv.sh"  # the train.preflight venv (Bridge 0.6.2, Python 3.12)
}

# vLLM's CPU build for the evaluate stage (docker/requirements-vllm.txt). The lock is an override:
# no locked package changes (vLLM only adds), so jobs running meanwhile keep their files. Stamped.
install_vllm() {
  local py=$1 req=$REPO_ROOT/docker/requirements-vllm.txt sum
  local ovr=$REPO_ROOT/docker/requirements-vllm-overrides.txt lock=$REPO_ROOT/requirements.lock
  shift
  sum=$(cat "$req" "$ovr" "$lock" | sha256sum | cut -d' ' -f1)
  [[ $(cat "$JOB_VENV/.vllm.sha256" 2>/dev/null) == "$sum" ]] && return 0
  log "installing vLLM's CPU build into $JOB_VENV"
  uv pip install --quiet --python "$py" "$@" --override "$lock" --override "$ovr" -r "$req" ||
    die "installing vLLM into $JOB_VENV failed"
  echo "$sum" >"$JOB_VENV/.vllm.sha256"
}

# Built from a scratch copy: setuptools writes build/ and *.egg-info next to the sources, and the
# package dirs may not all exist yet (others are writing them); placeholders never enter the repo.
install_project() {
  local scratch d sum
  scratch=$(mktemp -d)
  cp "$REPO_ROOT/pyproject.toml" "$scratch/"
  if [[ -f $REPO_ROOT/README.md ]]; then cp "$REPO_ROOT/README.md" "$scratch/"
  else log "WARNING: README.md missing; building with an empty one"; : >"$scratch/README.md"; fi
  for d in operators plugins jobscripts; do
    if [[ -d $REPO_ROOT/$d ]]; then
      tar -C "$REPO_ROOT" --exclude=__pycache__ -cf - "$d" | tar -C "$scratch" -xf -
    else
      log "WARNING: $d/ missing; installing without it"
      mkdir "$scratch/$d"
    fi
  done
  # Each version of the sources gets its own directory, named by their content, and the venv
  # finds the current one through a .pth file that is replaced in one rename. A job already
  # running keeps the sys.path it started with, so a reinstall never changes or removes a file
  # it may still import (installing in place into site-packages did: a module imported late
  # in a job came from the new tree, or was gone). An unchanged tree changes nothing.
  sum=$(cd "$scratch" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum |
    sha256sum | cut -d' ' -f1)
  local versions=$PROJECT_VERSIONS target site pth
  target="$versions/$sum"
  site=$("$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  pth="$site/$PROJECT_PTH"
  if [[ -d $target && $(cat "$pth" 2>/dev/null) == "$target" ]]; then
    rm -rf "$scratch"; return 0
  fi
  install -d -m 755 "$versions"
  if [[ ! -d $target ]]; then
    rm -rf "$target.partial"
    # --no-build-isolation: the lock's setuptools builds it, so no index is needed (offline).
    uv pip install --quiet --python "$1" --no-deps --no-build-isolation \
      --target "$target.partial" "$scratch" ||
      { rm -rf "$scratch" "$target.partial"; die "installing the project into $target failed"; }
    chmod -R a+rX "$target.partial"
    mv "$target.partial" "$target"
  fi
  rm -rf "$scratch"
  # Before versioned installs the project lived in site-packages itself, where it would shadow
  # the .pth: removed once (the only reinstall that touches files in place).
  if compgen -G "$site/pretrain_pipeline-*.dist-info" >/dev/null; then
    uv pip uninstall --quiet --python "$1" pretrain-pipeline || true
  fi
  printf '%s\n' "$target" >"$pth.tmp.$$"
  mv -f "$pth.tmp.$$" "$pth"
  # Old versions stay for jobs that started on them: the current one and the 4 before it.
  (cd "$versions" && ls -1t | grep -v -e '\.partial$' -e "^$sum\$" | tail -n +5 |
    xargs -r rm -rf --) || true
  log "pretrain-pipeline installed into $target (the current version for $JOB_VENV)"
}

# --- subcommands --------------------------------------------------------------------------------

cmd_up() {
  local t0=$SECONDS
  ensure_packages
  prepare_dirs
  ensure_user
  ensure_bridge  # before slurmdbd: slurmctld and the Slurm commands reach it at the bridge address
  start_munge
  write_slurm_configs
  start_mariadb
  start_daemon slurmdbd /usr/sbin/slurmdbd -D
  register_cluster
  start_daemon slurmctld /usr/sbin/slurmctld -D
  wait_for slurmctld 30 ctld_up
  write_node_hosts
  local n i=0
  for n in "${NODE_NAMES[@]}"; do
    i=$((i + 1))
    ensure_node_net "$n" "$i"
    start_slurmd "$n"
  done
  for n in "${NODE_NAMES[@]}"; do wait_for "slurmd-$n" 60 node_ready "$n"; done
  start_sshd
  write_airflow_env
  local faults=${FAULT_PARTITION#*Nodes=}
  log "cluster $CLUSTER up in $((SECONDS - t0))s (nodes $NODELIST${faults:+, faults ${faults%% *}}" \
    "on $BRIDGE $BRIDGE_ADDR/24, ssh $CLUSTER_USER@$SSH_HOST:$SSH_PORT)"
  cmd_sync_env
  log "done in $((SECONDS - t0))s; connection: $STATE/airflow.env"
}

# Jobs are cancelled through Slurm first: their processes belong to slurmstepd, not to us, and
# would otherwise outlive slurmd. Accounting keeps them (CANCELLED).
cmd_down() {
  local i
  if running_pid slurmctld >/dev/null && [[ -n $(squeue -h -o %A) ]]; then
    log "cancelling running jobs"
    squeue -h -o %A | xargs -r scancel || true
    for _ in $(seq 40); do [[ -z $(squeue -h -o %A) ]] && break; sleep 1; done
  fi
  # Every slurmd with a pid file of ours, whatever PP_CLUSTER_NODES says now (and `slurmd`, the
  # single node of earlier versions of this script).
  local f extra=()
  for f in "$STATE"/pids/slurmd*.pid; do
    [[ -e $f ]] || continue
    f=$(basename "$f" .pid)
    [[ " ${DAEMONS[*]} " == *" $f "* ]] || extra+=("$f")
  done
  for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
    [[ ${DAEMONS[i]} == sshd ]] && for f in "${extra[@]}"; do stop_daemon "$f"; done
    stop_daemon "${DAEMONS[i]}"
  done
  remove_node_nets
}

cmd_status() {
  local name pid rc=0
  for name in "${DAEMONS[@]}"; do
    if pid=$(running_pid "$name"); then printf '%-14s running (pid %s)\n' "$name" "$pid"
    else printf '%-14s DOWN\n' "$name"; rc=1; fi
  done
  if running_pid slurmctld >/dev/null; then sinfo -N -o '%N %P %T %o'; fi
  return "$rc"
}

cmd_env() {
  [[ -f $STATE/airflow.env ]] || die "$STATE/airflow.env not found; run '$0 up' first"
  cat "$STATE/airflow.env"
}

main() {
  [[ ${1:-} == env || $(id -u) == 0 ]] || die "run as root (it starts daemons, creates a user)"
  if [[ ${1:-} =~ ^(up|down|sync-env)$ ]]; then
    # Several test sessions may call `up` at once: one at a time, or both would start daemons.
    install -d -m 755 "$STATE"
    exec 9>"$STATE/lock"
    flock -w 600 9 || die "another local_cluster.sh holds $STATE/lock"
  fi
  case ${1:-} in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) cmd_env ;;
    sync-env) cmd_sync_env ;;
    *) echo "usage: $0 up|down|status|env|sync-env" >&2; exit 2 ;;
  esac
}

main "$@"
