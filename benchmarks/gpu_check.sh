#!/usr/bin/env bash
# The one call made first whenever a GPU is at hand: it installs what the machine lacks,
# runs the -m gpu tests, the GPU benchmark against transformers and torch, and the device
# budget, and leaves everything in one folder (the device tool brings $OUT back).
#
#   here, once:    bash benchmarks/gpu_check.sh --fetch       # wheels into .whl/ (ignored)
#   on the GPU:    bash benchmarks/gpu_check.sh               # (device run: carry .whl)
#
# On the GPU machine (Python 3.12, CuPy, torch, transformers, h5py there already) it writes
# to $OUT (else benchmarks/results/):
#   gpu-check-<date>.log    every step's output, in order
#   gpu-<date>.json         benchmarks/gpu.py's figures: decode (eager and --cuda-graphs)
#                           and prefill against transformers eager and compiled, training
#                           against torch (autocast, fused AdamW), the memory ratio
#   summary.txt             each step's exit status
# A step that fails is reported and the next runs: the point is to see everything at once.
# Each step has a time limit, so a lease's few minutes see every step: GPU_CHECK_BENCH sets
# benchmarks/gpu.py's arguments (default: 1B and 8B, +128, with --cuda-graphs and
# --fused-optimizer),
# GPU_CHECK_BUDGET=0 skips the device budget (a CPU count: the same here as there), a step's
# GPU_CHECK_*_SECONDS its limit (GPU_CHECK_SUITE_SECONDS=0 skips the CuPy suite).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=".whl"
# what the GPU machine lacks (its Python 3.12 has CuPy, torch, transformers, h5py)
PACKAGES=(mpich mpi4py pytest-mpi nvidia-cudnn-frontend nvmath-python)

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

out="${OUT:-benchmarks/results}"
mkdir -p "$out"
day=$(date +%F)
log="$out/gpu-check-$day.log"
summary="$out/summary.txt"
: > "$summary"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"

step() {   # step NAME SECONDS COMMAND...: run it (at most SECONDS), output to the log, status
  local name=$1 limit=$2; shift 2
  echo "== $name (at most $limit s): $*" | tee -a "$log"
  local start=$SECONDS
  if [[ $(type -t "$1") == function ]]; then "$@"; else timeout -k 10 "$limit" "$@"; fi 2>&1 \
    | tee -a "$log"
  local status=${PIPESTATUS[0]}
  echo "$name: exit $status in $((SECONDS - start)) s" | tee -a "$summary" "$log"
}

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

step install 120 install
[[ -e /tmp/site.env ]] && source /tmp/site.env     # (the step ran in a pipeline's subshell)
step machine 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  python3 -c "import cupy, mpi4py, h5py; print(\"cupy\", cupy.__version__, \"mpi4py\",
  mpi4py.__version__); print(cupy.cuda.runtime.getDeviceProperties(0)[\"name\"])"'
step gpu-tests "${GPU_CHECK_TESTS_SECONDS:-180}" python3 -m pytest -q -m gpu -p no:cacheprovider tests
[[ "${GPU_CHECK_BUDGET:-1}" == 0 ]] || step budget 120 python3 benchmarks/device_budget.py --shapes 1b
# packed rows (--pack): cuDNN's ragged graphs against the block-diagonal reference (off in jobs,
# varlen_attention.RAGGED, until this passes) and packed training steps on CuPy = transformers
[[ "${GPU_CHECK_PACKING_SECONDS:-120}" == 0 ]] || step packing "${GPU_CHECK_PACKING_SECONDS:-120}" \
  env HPCPAR_BACKEND=cupy python3 -m pytest -q -p no:cacheprovider -k "cudnn or apart" \
  tests/test_packing_attention.py tests/test_packing.py
# latent attention (DeepSeek): a tiny V3 on CuPy against NumPy, its rescaled scores through
# cuDNN (off in jobs, ops/cuda/attention.SCALED, until this passes)
[[ "${GPU_CHECK_MLA_SECONDS:-90}" == 0 ]] || step mla "${GPU_CHECK_MLA_SECONDS:-90}" \
  python3 -m pytest -q -m gpu -p no:cacheprovider -k latent tests/test_ops_gpu.py
# ZeRO 2 and 3 on CuPy arrays (4 ranks on the one GPU, over MPI: NCCL takes one rank per GPU):
# every stage's steps and checkpoints against the single rank's
[[ "${GPU_CHECK_ZERO_SECONDS:-120}" == 0 ]] || step zero "${GPU_CHECK_ZERO_SECONDS:-120}" \
  env HPCPAR_BACKEND=cupy mpiexec -n 4 python3 -m pytest -q --with-mpi -p no:cacheprovider \
  -k "every_zero_stage and gqa" tests/test_train_mpi.py
# shellcheck disable=SC2086
step benchmark "${GPU_CHECK_BENCH_SECONDS:-420}" python3 benchmarks/gpu.py \
  ${GPU_CHECK_BENCH:---models 1b,8b --new-tokens 128 --cuda-graphs --fused-optimizer}
# the paged KV cache and scoring's shared beginnings on the GPU (behind their switch): tokens
# and log-probs against the contiguous cache's, and the ratios of benchmarks/prefix.py
[[ "${GPU_CHECK_PREFIX_SECONDS:-90}" == 0 ]] || step prefix "${GPU_CHECK_PREFIX_SECONDS:-90}" \
  env HPCPAR_BACKEND=cupy HPCPAR_PAGED_DEVICE=1 python3 benchmarks/prefix.py --no-transformers \
  --workloads shared,choices --json "benchmarks/results/prefix-gpu-$day.json"
[[ "${GPU_CHECK_SUITE_SECONDS:-150}" == 0 ]] || step cupy-suite "${GPU_CHECK_SUITE_SECONDS:-150}" env HPCPAR_BACKEND=cupy python3 -m pytest -q -x -m "not mpi" \
  -p no:cacheprovider tests/test_model.py tests/test_generate_cli.py tests/test_logprobs.py \
  tests/test_samples.py
cp benchmarks/results/nvidia-*-"$day".json "$out/gpu-$day.json" 2>/dev/null
cp "benchmarks/results/prefix-gpu-$day.json" "$out/" 2>/dev/null
echo "== summary" && cat "$summary"
