#!/usr/bin/env bash
# The local stand-in for the training image: a second cluster-side venv, on Python 3.12, with
# Megatron Bridge 0.6.2 and Megatron Core 0.19.2, in which the `train.preflight` job runs
# jobscripts.bridge_preflight (the jobscripts the campaign ships; no copy of this project is
# installed here). Called by docker/local_cluster.sh (up, sync-env); as root.
#
#   docker/bridge_venv.sh            install or update; a second call changes nothing
#
# Why it looks like this:
# - Bridge 0.6.2 and Core 0.19.2 need Python 3.12; Debian 12 has 3.11 only. pyenv's 3.12.1
#   lives under /root (mode 700), which the cluster user cannot read, so a copy of it goes under
#   /opt, with its interpreter's RUNPATH (absolute, into /root) made relative to the copy.
# - megatron-bridge is installed without its dependencies: its metadata pulls in GPU-only
#   packages (nvidia-resiliency-ext needs glibc 2.39, flashinfer, transformer-engine). The venv is
#   synced to docker/bridge-requirements.lock (fully pinned; `uv pip sync` installs exactly it,
#   resolving nothing), so the set is exactly the lock's.
# - transformer_engine's torch extension cannot be built without CUDA: the import-only stand-in
#   in docker/standins/ goes in (see its README). It never reaches a production image.
set -euo pipefail

REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BASE=${PP_BRIDGE_PYTHON_HOME:-/opt/pretrain-pipeline/python3.12}
VENV=${PP_BRIDGE_VENV:-/opt/pretrain-pipeline/bridge-venv}
LOCK=$REPO_ROOT/docker/bridge-requirements.lock
STANDIN=$REPO_ROOT/docker/standins/transformer_engine
PY_VERSION=3.12.1

log() { printf '[bridge_venv] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# The stamp: the lock, the stand-in and this script. Same stamp -> nothing to do.
want=$(cat "$LOCK" "$0" $(find "$STANDIN" -type f -name '*.py' | sort) | sha256sum | cut -d' ' -f1)
if [[ -x $VENV/bin/python && $(cat "$VENV/.stamp.sha256" 2>/dev/null) == "$want" ]]; then
  log "up to date: $VENV"
  exit 0
fi
t0=$SECONDS

# --- Python 3.12, readable by the cluster user ----------------------------------------------
if [[ ! -x $BASE/bin/python3.12 ]]; then
  # A non-login shell (CI, cron) may lack pyenv's PATH set-up from ~/.bashrc.
  [[ -x ${PYENV_ROOT:-$HOME/.pyenv}/bin/pyenv ]] && PATH=${PYENV_ROOT:-$HOME/.pyenv}/bin:$PATH
  command -v pyenv >/dev/null || die "pyenv not found: Python $PY_VERSION is needed for Bridge"
  src=$(pyenv prefix "$PY_VERSION") || die "pyenv has no Python $PY_VERSION"
  command -v patchelf >/dev/null || {
    log "installing patchelf"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends patchelf >/dev/null
  }
  log "copying Python $PY_VERSION from $src to $BASE"
  tmp=$BASE.tmp.$$
  rm -rf "$tmp"
  mkdir -p "$(dirname "$BASE")"
  cp -a "$src" "$tmp"
  # Its pip and its .pth files belong to the root user's setup, not to the jobs.
  find "$tmp/lib/python3.12/site-packages" -mindepth 1 -maxdepth 1 ! -name README.txt \
    -exec rm -rf {} +
  patchelf --set-rpath "\$ORIGIN/../lib" "$tmp/bin/python3.12"
  chmod -R a+rX "$tmp"
  mv "$tmp" "$BASE"
fi

# --- the venv -----------------------------------------------------------------------------------
command -v uv >/dev/null || /usr/bin/python3 -m pip install --quiet --break-system-packages uv
[[ -x $VENV/bin/python ]] || uv venv --quiet --python "$BASE/bin/python3.12" "$VENV"
log "installing docker/bridge-requirements.lock into $VENV"
uv pip sync --quiet --python "$VENV/bin/python" "$LOCK"
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -rf "$site/transformer_engine"
cp -r "$STANDIN" "$site/transformer_engine"
find "$site/transformer_engine" -name __pycache__ -prune -exec rm -rf {} +
chmod -R a+rX "$VENV"
# As the jobs will run it: the cluster user, no project on the path.
su -s /bin/sh pretrain -c "cd / && '$VENV/bin/python' -c 'import megatron.bridge.training.config'" \
  || die "the Bridge venv does not import megatron.bridge.training.config as user pretrain"
echo "$want" >"$VENV/.stamp.sha256"
log "ready in $((SECONDS - t0))s: $VENV ($(du -sh "$VENV" | cut -f1))"
