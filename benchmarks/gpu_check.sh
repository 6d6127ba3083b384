#!/usr/bin/env bash
# The GPU check, in one command (benchmarks/README.md, "GPU check"):
#
#   bash benchmarks/gpu_check.sh           # on a GPU machine: DDP + FSDP2 on NCCL, undisturbed and
#                                          # with a kill-rank, bit-identity checked; < 8 minutes
#   bash benchmarks/gpu_check.sh --dry     # the same sequence on the CPU with gloo (the test suite's run)
#
# Other flags go to benchmarks/gpu_check.py (--json PATH, --config shared|hostid|split|mig, --force,
# --no-zygote, --workdir DIR, ...; `--help` lists them).
#
# Set-up. --dry uses the project's virtualenv (.venv; `make setup` makes it if it is missing). The GPU
# run downloads nothing: it needs a Python whose torch has CUDA -- $HOTSPARE_GPU_PYTHON, else .venv's,
# python3's or python's, the first whose torch sees a GPU -- and an `etcd` binary (PATH, /usr/bin/etcd
# or $HOTSPARE_ETCD_BIN). If that Python cannot import hotspare, hotspare is put on its path from this
# checkout (no install), and a package it lacks (yaml, etcd3, grpc, safetensors, ...) is taken from
# .venv when .venv has the same Python version, or installed with `pip --no-index` from
# $HOTSPARE_GPU_WHEELS (a directory of wheels) into a temp dir. Whatever is missing is named, and the
# script exits 3 without running anything.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 3
repo=$(pwd)

dry=0
for arg in "$@"; do
  [ "$arg" = "--dry" ] && dry=1
  if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then
    exec "$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)" benchmarks/gpu_check.py --help
  fi
done

say() { echo "gpu_check.sh: $*" >&2; }

if [ "$dry" = 1 ]; then
  if [ ! -x .venv/bin/python ] || ! (cd / && "$repo/.venv/bin/python" -c "import hotspare.recovery.session") >/dev/null 2>&1; then
    say "no usable .venv: running make setup"
    make setup || { say "make setup failed"; exit 3; }
  fi
  # hide any GPU: the dry run is CPU and gloo wherever it runs
  exec env CUDA_VISIBLE_DEVICES= PYTHONUNBUFFERED=1 .venv/bin/python benchmarks/gpu_check.py "$@"
fi

# -- GPU: the machine's CUDA torch, nothing downloaded ---------------------------------------------
py=""
tried=()
for cand in "${HOTSPARE_GPU_PYTHON:-}" .venv/bin/python python3 python; do
  [ -n "$cand" ] || continue
  exe=$(command -v "$cand" 2>/dev/null) || continue
  why=$("$exe" - <<'EOF' 2>&1
import sys
try:
    import torch
except Exception as e:
    print(f"no torch ({type(e).__name__}: {e})"); sys.exit(1)
if not torch.version.cuda:
    print(f"torch {torch.__version__} is a CPU build"); sys.exit(1)
if not torch.cuda.is_available():
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"); sys.exit(1)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s)")
EOF
  )
  rc=$?
  tried+=("$exe: $(echo "$why" | tail -1)")
  if [ "$rc" = 0 ]; then
    py=$exe
    say "using $exe: $(echo "$why" | tail -1)"
    break
  fi
done
if [ -z "$py" ]; then
  say "no Python with a CUDA-enabled torch that sees a GPU was found; this check uses the machine's own"
  say "CUDA torch and downloads nothing (set HOTSPARE_GPU_PYTHON=/path/to/python to name one). Tried:"
  for t in "${tried[@]}"; do say "  $t"; done
  exit 3
fi

etcd_bin=""
for cand in "${HOTSPARE_ETCD_BIN:-}" "$(command -v etcd 2>/dev/null)" /usr/bin/etcd; do
  if [ -n "$cand" ] && [ -x "$cand" ]; then etcd_bin=$cand; break; fi
done
if [ -z "$etcd_bin" ]; then
  say "no etcd binary (PATH, /usr/bin/etcd, \$HOTSPARE_ETCD_BIN): the jobs' control plane needs one; install"
  say "etcd-server from the machine's package mirror or copy the binary here and set HOTSPARE_ETCD_BIN"
  exit 3
fi
export HOTSPARE_ETCD_BIN=$etcd_bin

# hotspare importable by $py: an install in its environment, or this checkout through a path directory
check_imports() {  # from / : the checkout's own hotspare/ (no subpackages there) must not shadow the path's
  (cd / && "$py" -W ignore -c "import hotspare.orchestrator.cli, hotspare.recovery.session, hotspare.agents.worker, etcd3, yaml, safetensors, six, numpy" 2>&1 | tail -1)
}
shim=""
missing=$(check_imports)
if [ -n "$missing" ]; then
  shim=$(mktemp -d "${TMPDIR:-/tmp}/hotspare-gpu-path.XXXXXX")
  mkdir -p "$shim/hotspare"
  ln -s "$repo/hotspare/__init__.py" "$shim/hotspare/__init__.py"
  ln -s "$repo/orchestrator" "$shim/hotspare/orchestrator"
  ln -s "$repo/agents" "$shim/hotspare/agents"
  ln -s "$repo/recovery" "$shim/hotspare/recovery"
  export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
  pyver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  venv_site=""
  if [ -x .venv/bin/python ] && [ "$(.venv/bin/python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")' 2>/dev/null)" = "$pyver" ]; then
    venv_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  fi
  if [ -n "${HOTSPARE_GPU_WHEELS:-}" ]; then
    say "installing the wheels in $HOTSPARE_GPU_WHEELS (no index, no network) into $shim"
    "$py" -m pip install -q --no-index --no-deps --target "$shim" "$HOTSPARE_GPU_WHEELS"/*.whl \
      || { say "pip install from $HOTSPARE_GPU_WHEELS failed"; exit 3; }
  fi
  for _ in $(seq 30); do
    missing=$(check_imports)
    [ -n "$missing" ] || break
    mod=$(echo "$missing" | sed -n "s/.*No module named '\([^'.]*\).*/\1/p")
    if [ -z "$mod" ] || [ "$mod" = torch ] || [ -z "$venv_site" ] || [ -e "$shim/$mod" ] || [ -e "$shim/$mod.py" ]; then
      break
    fi
    found=0
    for p in "$venv_site/$mod" "$venv_site/$mod.py" "$venv_site/$mod".*.so; do
      if [ -e "$p" ]; then ln -s "$p" "$shim/$(basename "$p")"; found=1; fi
    done
    [ -d "$venv_site/$mod.libs" ] && ln -s "$venv_site/$mod.libs" "$shim/$mod.libs"
    [ "$found" = 1 ] || break
    say "taking $mod from .venv ($venv_site)"
  done
  if [ -n "$missing" ]; then
    say "$py cannot import hotspare's dependencies: $missing"
    say "nothing is downloaded here: install them into that Python from a local mirror, or put their wheels"
    say "(python3-etcd3 grpcio protobuf PyYAML safetensors numpy six) in a directory and set HOTSPARE_GPU_WHEELS"
    rm -rf "$shim"
    exit 3
  fi
  say "hotspare from $repo on $py's path (through $shim)"
fi

PYTHONUNBUFFERED=1 "$py" benchmarks/gpu_check.py "$@"
rc=$?
[ -n "$shim" ] && rm -rf "$shim"
exit $rc
