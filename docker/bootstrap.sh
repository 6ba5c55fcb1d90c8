#!/usr/bin/env bash
# Installs what the project needs on a fresh Debian 12 machine, as root: the system packages
# of the local cluster and the project's venv (.venv) from the lock file. Idempotent and quick
# when nothing changed (a stamp holds the lock's hash).
#
#   docker/bootstrap.sh            system packages + .venv
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${PP_VENV:-$REPO_ROOT/.venv}
PYTHON=${PP_PYTHON:-python3.11}
PACKAGES=(slurm-wlm slurmdbd mariadb-server munge openssh-server openssh-client procps psmisc)

log() { printf '[bootstrap] %s\n' "$*" >&2; }

missing=()
for pkg in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  log "apt-get install ${missing[*]}"
  apt-get update -qq
  # The daemons are started by docker/local_cluster.sh, never by the package scripts.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

command -v uv >/dev/null || python3 -m pip install -q uv
# torch's CPU wheel lies on disk on this kind of machine; uv only finds it through --find-links.
find_links=()
[[ -d /opt/wheels ]] && find_links=(--find-links /opt/wheels)

stamp=$VENV/.lock.sha256
want=$(cat "$REPO_ROOT/requirements.lock" "$REPO_ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)
if [[ ! -x $VENV/bin/python || $(cat "$stamp" 2>/dev/null) != "$want" ]]; then
  log "creating $VENV from requirements.lock"
  [[ -x $VENV/bin/python ]] || uv venv -q --python "$(command -v "$PYTHON")" "$VENV"
  uv pip install -q --python "$VENV/bin/python" "${find_links[@]}" -r "$REPO_ROOT/requirements.lock"
  uv pip install -q --python "$VENV/bin/python" --no-deps -e "$REPO_ROOT"
  echo "$want" > "$stamp"
fi
log "venv ready: $VENV"
