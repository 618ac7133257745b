#!/usr/bin/env bash
# One full GPU session: build the extension, run tests/gpu with several ranks per GPU under MPS, run the
# benchmarks. Logs and JSON go to $OUT (default /tmp/ep_out). Usage: bash tests/gpu/run_device.sh [quick]
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never use NVLink multicast
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=${MAX_JOBS:-16}
OUT=${OUT:-/tmp/ep_out}; mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())' | tee -a "$OUT/gpu.txt"

start=$(date +%s)
python3 -m pip install --no-deps --no-build-isolation -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
grep "ep_dispatcher setup" "$OUT/build.log"; echo "build: $(( $(date +%s) - start )) s"

start_mps() {
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
    nvidia-cuda-mps-control -d && sleep 1
}
stop_mps() { echo quit | nvidia-cuda-mps-control 2>/dev/null; sleep 1; }

rc=0
start_mps
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_layout_gpu.py tests/gpu/test_intranode_gpu.py tests/gpu/test_dbo_gpu.py tests/test_extension_import.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
stop_mps
if [ "${1:-}" != "quick" ]; then
    start_mps
    python3 benchmarks/bench_intranode.py --ranks 8 --num-sms 16 --sweep ${EP_BENCH_SWEEP:-4096} --calls 5 --groups 3 --out "$OUT/bench_intranode_16sms.json" 2>&1 | tee "$OUT/bench.log" | grep -v "^\s*$"
    [ "${EP_BENCH_8SMS:-1}" = 1 ] && python3 benchmarks/bench_intranode.py --ranks 8 --num-sms 8 --sweep 4096 --calls 5 --groups 3 --out "$OUT/bench_intranode_8sms.json" 2>&1 | tee -a "$OUT/bench.log" | grep -v "^\s*$"
    timeout 120 python3 benchmarks/bench_dbo.py --device cuda --ranks 4 --tokens 64,128,256 --out "$OUT/bench_dbo.json" 2>&1 | tee -a "$OUT/bench.log" | grep -v "^\s*$"
    timeout 120 python3 benchmarks/bench_megatron_step.py --device cuda --ranks 2 --layers 2 --hidden 1024 --heads 8 --experts 16 --topk 4 --seq 1024 --tokens 4096 --dtype bf16 --steps 10 --warmup 3 --out "$OUT/bench_megatron.json" 2>&1 | tee -a "$OUT/bench.log" | grep -v "^\s*$"
    stop_mps
fi
# Internode engine (NVSHMEM, virtual nodes on one GPU), in its own MPS session: a hung NVSHMEM job cannot block the
# earlier groups, and MPS restarts clean for the next one.
start_mps
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_internode_gpu.py 2>&1 | tee "$OUT/internode_tests.log" | tail -30
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
if [ "${1:-}" != "quick" ]; then
    timeout 240 python3 benchmarks/bench_internode.py --ranks 8 --ranks-per-node 4 --num-sms 16 --sweep 4096 --calls 5 --groups 3 --profile --out "$OUT/bench_internode_2x4.json" 2>&1 | tee "$OUT/bench_internode.log" | grep -v "^\s*$"
    timeout 240 python3 benchmarks/bench_internode.py --ranks 8 --ranks-per-node 2 --num-sms 16 --sweep 4096 --calls 5 --groups 3 --out "$OUT/bench_internode_4x2.json" 2>&1 | tee -a "$OUT/bench_internode.log" | grep -v "^\s*$"
fi
unset NVSHMEM_REMOTE_TRANSPORT NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME
stop_mps
# Last, in its own MPS session: the timeout test traps a kernel on purpose.
start_mps
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_timeout_gpu.py 2>&1 | tee "$OUT/timeout_test.log" | tail -5
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
stop_mps
exit $rc
