#!/usr/bin/env bash
# The one call made first whenever a GPU is at hand: it installs what the machine lacks from
# the carried wheels, then runs benchmarks/gpu_check.py's steps (the -m gpu tests, the GPU
# benchmark against transformers and torch, every device test on CuPy, the paths behind their
# switches) inside one time budget, everything written to $OUT (else benchmarks/results/).
#
#   here, once:    bash benchmarks/gpu_check.sh --fetch       # wheels into .whl/ (ignored)
#   on the GPU:    bash benchmarks/gpu_check.sh               # (device run: carry .whl)
#
# GPU_CHECK_STEPS picks steps (python3 benchmarks/gpu_check.py --list names them),
# GPU_CHECK_TOTAL_SECONDS is the whole call's budget, install included (default 540).
# Afterwards, here: copy $OUT's JSON files into benchmarks/results/ and run
# python benchmarks/gpu_paths.py --write (the README's table of what has run on a GPU).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=".whl"
# what the GPU machine lacks (its Python 3.12 has CuPy, torch, transformers, h5py, pytest):
# MPI, the GPU extras, the test extra's pytest plugins and peft (the LoRA tests' reference)
PACKAGES=(mpich mpi4py pytest-mpi nvidia-cudnn-frontend nvmath-python pytest-xdist execnet
          hypothesis attrs sortedcontainers peft==0.21.2 accelerate psutil)

if [[ "${1:-}" == "--fetch" ]]; then
  exclude="$(git rev-parse --git-common-dir)/info/exclude"       # (a worktree's too)
  grep -qx "/$WHEELS/" "$exclude" 2>/dev/null || echo "/$WHEELS/" >> "$exclude"
  for p in "${PACKAGES[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" "$p" \
      || echo "gpu_check: could not fetch $p" >&2
  done
  ls -la "$WHEELS"
  exit 0
fi

export GPU_CHECK_STARTED=$(date +%s) PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
install() {
  local site=/tmp/site
  if ! ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    echo "no $WHEELS/*.whl carried: using what the machine has"
    return 0
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$WHEELS"/*.whl || return 1
  # pip --target leaves out the mpich wheel's data files: its libraries and mpiexec
  for w in "$WHEELS"/mpich-*.whl; do
    [[ -e "$w" ]] || continue
    rm -rf /tmp/mpich && mkdir -p /tmp/mpich && python3 -m zipfile -e "$w" /tmp/mpich
    mkdir -p "$site/lib" "$site/bin"
    cp -a /tmp/mpich/*.data/data/lib/. "$site/lib/" 2>/dev/null
    cp -a /tmp/mpich/*.data/data/bin/. "$site/bin/" 2>/dev/null
    chmod +x "$site/bin/"*                  # (zipfile keeps no mode bits)
  done
  echo "export PYTHONPATH=$site:\$PYTHONPATH LD_LIBRARY_PATH=$site/lib:\${LD_LIBRARY_PATH:-} PATH=$site/bin:\$PATH" > /tmp/site.env
}

install || echo "gpu_check: the install failed; going on with what the machine has" >&2
[[ -e /tmp/site.env ]] && source /tmp/site.env
exec python3 benchmarks/gpu_check.py --steps "${GPU_CHECK_STEPS:-}"
