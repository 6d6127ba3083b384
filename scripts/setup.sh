#!/usr/bin/env bash
# One-shot set-up for a fresh machine: etcd server, a venv with torch (CPU build unless a GPU
# is present) and hotspare with its dev extras. Safe to re-run.
set -euo pipefail
venv=${1:-.venv}
torch_version=${2:-2.13.0}

if ! command -v etcd >/dev/null 2>&1 && [ ! -x /usr/bin/etcd ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "setup: installing etcd-server from apt (no etcd binary found)"
    apt-get install -y etcd-server >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y etcd-server >/dev/null; }
  else
    echo "setup: no 'etcd' binary found and not root." >&2
    echo "       Install it (sudo apt-get install -y etcd-server) or put etcd on PATH, then re-run." >&2
    exit 1
  fi
fi
# Debian enables a system etcd service on install; hotspare starts its own etcd on a free port.

# The Slurm backend's tests run a real Slurm (slurmctld + several slurmd) on this host.
if ! command -v slurmctld >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "setup: installing slurm-wlm from apt (for the Slurm backend's tests)"
  apt-get install -y slurm-wlm >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y slurm-wlm >/dev/null; }
fi

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
pip="$venv/bin/python -m pip"
if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
  # Pin torch explicitly first: an open range would pull a multi-GB CUDA build.
  echo "setup: installing torch==$torch_version"
  $pip install -q "torch==$torch_version"
fi
echo "setup: installing hotspare[dev]"
$pip install -q -e ".[dev]"
echo "setup: ok ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'), $(etcd --version | head -1))"
