#!/usr/bin/env bash
# Intranode sweep, ours and DeepEP v1.2.1 in the same device call (issue 18 item 8): the anchor's side-by-side driver
# (.deepep/side_by_side.py, put there by ../shared/anchor/prepare_deepep.sh) for every tokens-per-rank x SMs pair,
# both libraries back to back per pair, plus the copy bandwidth. Run on the GPU machine after our build:
#   bash benchmarks/sweep_vs_deepep.sh ["512 2048 8192"] ["8 16 24"] [RANKS]
# Output: $OUT/sweep.jsonl (one JSON line per (impl, ranks, sms, tokens)); draw it with benchmarks/plot_sweep.py.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ep_out}; mkdir -p "$OUT"
root=$PWD
dd=$root/.deepep/DeepEP
[ -f "$root/.deepep/side_by_side.py" ] || { echo "no .deepep: run bash ../shared/anchor/prepare_deepep.sh .deepep"; exit 1; }
if ! ls $dd/deep_ep_cpp*.so >/dev/null 2>&1; then
  (cd $dd && DEEPEP_FORCE_NO_NVSHMEM=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16} \
      python3 setup.py build_ext --inplace > "$OUT/build_deepep.log" 2>&1) || { tail -30 "$OUT/build_deepep.log"; exit 1; }
fi
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
python3 "$root/.deepep/side_by_side.py" --copy | tee -a "$OUT/sweep.jsonl"
ranks=${3:-8}
for sms in ${2:-8 16 24}; do
  for tokens in ${1:-512 2048 8192}; do
    for impl in deepep ours; do
      nvidia-cuda-mps-control -d; sleep 1
      pp=$root; [ $impl = deepep ] && pp=$dd
      PYTHONPATH=$pp timeout 150 python3 "$root/.deepep/side_by_side.py" --impl $impl --ranks "$ranks" --sms "$sms" \
          --tokens "$tokens" --iters 10 2>&1 | grep '^{' | tee -a "$OUT/sweep.jsonl"
      echo quit | nvidia-cuda-mps-control; sleep 1
    done
  done
done
