#!/usr/bin/env bash
# NOT EXERCISED HERE: no Docker engine can run on the machine where this project is developed.
#
# Run once by docker/compose.yml (service slurm-connection, as root, in the Airflow image) after
# the slurm container is healthy. It turns what docker/local_cluster.sh wrote into the Airflow
# connection `slurm_local` for the Airflow containers:
#   - the client key, which the cluster writes root-only, copied for the `airflow` user (uid 50000);
#   - the connection JSON, its key_file pointed at that copy. Its host_key stays the sshd's own
#     public key, read from the cluster's state volume rather than over the network, so host-key
#     checking stays on and nothing is trusted on first use.
# The Airflow containers source the result ($OUT/connections.env) before starting airflow.
set -euo pipefail

STATE=${PP_CLUSTER_STATE:-/cluster}   # the slurm container's /var/lib/pretrain-cluster, read-only
OUT=${PP_SLURM_CONN_DIR:-/opt/airflow/slurm}
AIRFLOW_UID=${AIRFLOW_UID:-50000}

# `up` writes airflow.env just after it starts sshd, and the container's health check looks only
# at the daemons: wait for the file rather than race it.
for _ in $(seq 60); do
  [[ -s $STATE/airflow.env && -s $STATE/id_ed25519 ]] && break
  sleep 2
done
if [[ ! -s $STATE/airflow.env ]]; then
  echo "no $STATE/airflow.env after 120 s: is the slurm service up?" >&2
  exit 1
fi

install -d -o "$AIRFLOW_UID" -g 0 -m 750 "$OUT"
install -o "$AIRFLOW_UID" -g 0 -m 600 "$STATE/id_ed25519" "$OUT/id_ed25519"

# Written next to the target and renamed, so a reader never sources half a file.
tmp=$(mktemp "$OUT/.connections.env.XXXXXX")
trap 'rm -f "$tmp"' EXIT
python3 - "$STATE/airflow.env" "$OUT/id_ed25519" >"$tmp" <<'PY'
import json, re, shlex, sys

text = open(sys.argv[1]).read()
match = re.search(r"AIRFLOW_CONN_SLURM_LOCAL='(.*)'", text)
if not match:
    sys.exit(f"{sys.argv[1]} has no AIRFLOW_CONN_SLURM_LOCAL")
conn = json.loads(match.group(1))
extra = conn["extra"]
if not extra.get("host_key") or extra.get("no_host_key_check"):
    sys.exit("the cluster connection has no pinned host_key; refusing to write it")
extra["key_file"] = sys.argv[2]
print("export AIRFLOW_CONN_SLURM_LOCAL=" + shlex.quote(json.dumps(conn)))
print(f"slurm_local: {conn['login']}@{conn['host']}:{conn['port']}, host key pinned",
      file=sys.stderr)
PY
chown "$AIRFLOW_UID:0" "$tmp"
chmod 640 "$tmp"
mv -f "$tmp" "$OUT/connections.env"
