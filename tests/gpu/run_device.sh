#!/usr/bin/env bash
# GPU session: build the extension, run tests/gpu with several ranks per GPU under MPS, run the benchmarks.
# Logs and JSON go to $OUT (default /tmp/ep_out).
# The build phase uses an extension carried from the workstation when it matches (tests/gpu/prebuild_extension.sh).
# Usage: bash tests/gpu/run_device.sh [PHASE...]   phases: build tests pending ll bench internode internode_bench
#   timeout deepep_tests (default: all but deepep_tests, in order); bench = ll_bench intranode_bench dbo_bench
#   megatron_bench, each also a phase. pending reruns the pending kernels' tests (PENDING_TEST_FILES below) with
#   EP_DISPATCHER_PENDING_KERNELS=1. deepep_tests runs DeepEP v1.2.1's own tests against us (tests/gpu/deepep_tests/);
#   ll_phases (issue 19) prints the low-latency kernels' phases at 8 ranks x 128 tokens, then with 4x the slot stride;
#   megatron_flex trains with Megatron's own flex/deepep dispatcher through install_as_deep_ep() vs our plugin;
#   megatron_rows (issue 21) times rows (a) our plugin, (b) Megatron's flex dispatcher on REAL DeepEP v1.2.1 (built
#   in .deepep/DeepEP if needed: carry .deepep) and (c) the flex dispatcher on the switch, at 2 and 4 ranks.
#   side_by_side (issue 18) runs .deepep/run_side_by_side.sh on "$EP_SBS_CONFIGS" (default "8:16 8:8 4:24"; carry
#   .deepep); select runs pytest on $EP_SELECT (files and flags, e.g. "-x tests/gpu/test_low_latency_gpu.py -k graph").
# Each phase after build runs in its own MPS session: a killed multi-process test can leave MPS refusing clients.
# EP_DEVICE_LIMIT_S (seconds, e.g. the device call's limit): a phase that would start with under 60 s left is skipped
# and said so, so the logs of the phases that ran still come back before the call is killed.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never use NVLink multicast
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo  # one GPU, no NIC (DESIGN.md 5)
export PYTHONUNBUFFERED=1 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} MAX_JOBS=${MAX_JOBS:-16}
OUT=${OUT:-/tmp/ep_out}; mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
PHASES=${*:-build tests pending ll bench internode internode_bench timeout}
# The GPU tests of the kernels that have not yet run on a GPU (csrc/kernels/pending_kernels.h; docs/architecture.md,
# "Pending kernels"). The C++ reads EP_DISPATCHER_PENDING_KERNELS once per process, so the `pending` phase reruns these
# files with it set (the `tests` and `ll` phases run them without). One file per line; a new pending kernel appends its.
PENDING_TEST_FILES=(
    tests/gpu/test_layout_gpu.py
    tests/gpu/test_low_latency_gpu.py
    tests/gpu/test_logfmt_gpu.py
    tests/gpu/test_dbo_gpu.py
)
# EP_PENDING_FILES="a.py b.py" runs those instead: all four need more than one 600 s device call (the LL file alone took
# 282 s for 21 tests in run W4), so a session splits them over calls.
if [ -n "${EP_PENDING_FILES:-}" ]; then read -ra PENDING_TEST_FILES <<< "$EP_PENDING_FILES"; fi
# NVSHMEM's host library, for an extension built on the workstation (tests/gpu/prebuild_extension.sh: its rpath points
# at the workstation's wheel).
nvlib=$(python3 -c 'import nvidia.nvshmem, os; print(os.path.join(list(nvidia.nvshmem.__path__)[0], "lib"))' 2>/dev/null) &&
    export LD_LIBRARY_PATH="$nvlib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Whether the carried extension (prebuild_extension.sh) was built for this machine's torch and NVSHMEM, and imports.
prebuilt_matches() {
    [ -f ep_dispatcher/_C.prebuilt.txt ] || return 1
    local here
    here=$(python3 2>/dev/null <<'EOF'
import importlib.metadata as m
import torch
print(f"torch={torch.__version__} nvshmem={m.version('nvidia-nvshmem-cu13')}")
EOF
) || return 1
    [ "$here" = "$(cat ep_dispatcher/_C.prebuilt.txt)" ] && python3 -c 'import ep_dispatcher._C' 2>/dev/null
}
# Packages carried from the workstation (tests/gpu/prepare_carry.sh: megatron-core for the Megatron step benchmark).
[ -d .device_carry/site ] && export PYTHONPATH="$PWD/.device_carry/site${PYTHONPATH:+:$PYTHONPATH}"

start_mps() {
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
    nvidia-cuda-mps-control -d && sleep 1
}
stop_mps() { echo quit | nvidia-cuda-mps-control 2>/dev/null; sleep 1; }
phase_start() { echo "=== $1 ($(date +%T))"; t0=$(date +%s); }
phase_end() { echo "=== $1 done: $(( $(date +%s) - t0 )) s"; }
# One benchmark in a fresh MPS session (a benchmark killed by its timeout can leave MPS refusing new clients).
bench() {
    start_mps
    timeout "$1" python3 "${@:2}" 2>&1 | tee -a "$OUT/bench.log" | grep -v "^\s*$"
    pkill -9 -f "multiprocessing.spawn" 2>/dev/null
    stop_mps
}

# pytest on GPU test files in a fresh MPS session: gpu_tests LOG TIMEOUT FILE...; a failure sets rc.
gpu_tests() {
    start_mps
    timeout "$2" python3 -m pytest -q -p no:cacheprovider "${@:3}" 2>&1 | tee "$OUT/$1" | tail -30
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    stop_mps
}

# The benchmarks, one function each (phase names ll_bench ... internode_bench; "bench" runs the first four).
# Issue 19: where the 8-rank pair goes, phase by phase (every block's global-timer stamps), and the same with the
# receive slots spread over 4x the memory (--max-tokens): if the send slows, the spread of its writes is a cost.
ll_phases() {
    bench 90 benchmarks/profile_low_latency.py --ranks 8 --sweep 128 --phase-trace
    bench 90 benchmarks/profile_low_latency.py --ranks 8 --sweep 128 --phase-trace --max-tokens 512
}
ll_bench() {  # EP_LL_RANKS="1 8": also one rank alone (no peers, no MPS sharing) to separate kernel cost from skew
    for r in ${EP_LL_RANKS:-8}; do
        bench 150 benchmarks/bench_low_latency.py --ranks "$r" --sweep ${EP_LL_SWEEP:-1,32,128,256} --out "$OUT/bench_ll_$r.json"
    done
}
intranode_bench() {
    bench 150 benchmarks/bench_intranode.py --ranks 8 --num-sms 16 --sweep ${EP_BENCH_SWEEP:-4096} --calls 5 --groups 3 \
        --tune-sms 8,12,16,24 --out "$OUT/bench_intranode_16sms.json"
    cp configs/*.json "$OUT/" 2>/dev/null  # the tuned table (configs/<gpu>.json) comes back with the logs
    bench 60 benchmarks/bench_intranode.py --ranks 1 --num-sms 24 --sweep 4096 --calls 5 --groups 3 \
        --out "$OUT/bench_intranode_ep1.json"
}
dbo_bench() {  # eager steps, then the same steps as CUDA-graph replays
    bench 120 benchmarks/bench_dbo.py --device cuda --ranks 4 --tokens 64,128,256 --out "$OUT/bench_dbo.json"
    bench 120 benchmarks/bench_dbo.py --device cuda --ranks 4 --tokens 64,128,256 --graph --out "$OUT/bench_dbo_graph.json"
}
megatron_bench() {
    bench 120 benchmarks/bench_megatron_step.py --device cuda --ranks 2 --layers 2 --hidden 1024 --heads 8 \
        --experts 16 --topk 4 --seq 1024 --tokens 4096 --dtype bf16 --steps 10 --warmup 3 --out "$OUT/bench_megatron.json"
}
megatron_flex() {  # issue 20: Megatron's own flex dispatcher on ep_dispatcher via the deep_ep switch (2 ranks)
    bench 180 benchmarks/bench_megatron_step.py --device cuda --ranks 2 --layers 2 --hidden 1024 --heads 8 \
        --experts 16 --topk 4 --seq 1024 --tokens 2048 --dtype bf16 --steps 5 --warmup 2 --flex-switch \
        --out "$OUT/bench_megatron_flex.json"
}
# Real DeepEP v1.2.1 for row (b), built in place once per machine (as .deepep/run_side_by_side.sh does).
build_deepep() {
    local dd=.deepep/DeepEP
    if [ ! -d "$dd" ]; then
        echo "build_deepep: $dd is missing: run shared/anchor/prepare_deepep.sh and carry .deepep"; return 1
    fi
    ls $dd/deep_ep_cpp*.so >/dev/null 2>&1 && return 0
    (cd $dd && DEEPEP_FORCE_NO_NVSHMEM=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=$MAX_JOBS \
        python3 setup.py build_ext --inplace > "$OUT/build_deepep.log" 2>&1) || { tail -30 "$OUT/build_deepep.log"; return 1; }
}
# Issue 21: the three rows in one call, same model/weights/data, each row in its own processes (the benchmark
# spawns them one after another). Shape (MoE-dominated, fine-grained experts): 1 layer, hidden 4096, 32 heads,
# 64 experts of FFN 1024, top-8, 4096 tokens/rank (seq 1024 x 4), bf16. EP_MEGATRON_RANKS="2 4" by default.
# Experts: EP_MEGATRON_EXPERT_IMPL=grouped (default; examples/torch_grouped_experts.py, no host sync) or sequential
# (Megatron's SequentialMLP: host-bound, the ranks' drift lands in the first collective after it).
megatron_rows() {
    build_deepep || { rc=1; return; }
    for r in ${EP_MEGATRON_RANKS:-2 4}; do
        bench "${EP_MEGATRON_TIMEOUT:-420}" benchmarks/bench_megatron_step.py --device cuda --ranks "$r" \
            --rows "${EP_MEGATRON_ROWS:-ours,flex_deepep,flex_switch,ours_unfused}" \
            --deepep-path "$PWD/.deepep/DeepEP" --layers 1 --hidden 4096 --heads "${EP_MEGATRON_HEADS:-8}" \
            --kv-channels "${EP_MEGATRON_KV_CHANNELS:-128}" --moe-ffn 1024 --experts 64 \
            --topk 8 --seq 1024 --tokens 4096 --dtype bf16 --expert-impl "${EP_MEGATRON_EXPERT_IMPL:-grouped}" \
            --steps ${EP_MEGATRON_STEPS:-8} --warmup 8 --isolated-steps 3 \
            --row-timeout 120 --profile-dir "$OUT/megatron_profile_$r" --out "$OUT/bench_megatron_rows_$r.json"
    done
}
internode_bench() {  # EP_INTERNODE_PER_NODE="4 2": 8 ranks as 2 nodes x 4, then as 4 nodes x 2
    for p in ${EP_INTERNODE_PER_NODE:-4 2}; do
        bench 240 benchmarks/bench_internode.py --ranks 8 --ranks-per-node "$p" --num-sms 16 --sweep 4096 --calls 5 --groups 3 \
            $([ "$p" = 4 ] && echo --profile) --out "$OUT/bench_internode_8r_${p}pn.json"
    done
}

rc=0
started=$(date +%s)
for phase in $PHASES; do
    if [ "${EP_DEVICE_LIMIT_S:-0}" -gt 0 ] && [ $(( EP_DEVICE_LIMIT_S - ($(date +%s) - started) )) -lt 60 ]; then
        echo "=== $phase skipped: under 60 s of EP_DEVICE_LIMIT_S=$EP_DEVICE_LIMIT_S left"; rc=1; continue
    fi
    phase_start "$phase"
    case $phase in
    build)
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
        python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())' | tee -a "$OUT/gpu.txt"
        if prebuilt_matches; then
            echo "prebuilt extension ($(cat ep_dispatcher/_C.prebuilt.txt)): no build"
        else
            rm -f ep_dispatcher/_C.prebuilt.txt
            python3 -m pip install --no-deps --no-build-isolation -e . > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
            grep "ep_dispatcher setup" "$OUT/build.log"
        fi
        python3 -c 'import ep_dispatcher._C as C; print("nvshmem", C.has_nvshmem(), C.cuda_arch_list())'
        ;;
    tests)
        gpu_tests gpu_tests.log "${EP_TESTS_TIMEOUT:-420}" tests/gpu/test_layout_gpu.py tests/gpu/test_intranode_gpu.py \
            tests/gpu/test_expert_major_gpu.py \
            tests/gpu/test_dbo_gpu.py tests/test_extension_import.py
        ;;
    pending)
        export EP_DISPATCHER_PENDING_KERNELS=1
        gpu_tests pending_tests.log "${EP_PENDING_TIMEOUT:-600}" "${PENDING_TEST_FILES[@]}"
        unset EP_DISPATCHER_PENDING_KERNELS
        ;;
    ll)
        gpu_tests ll_tests.log "${EP_LL_TIMEOUT:-420}" tests/gpu/test_low_latency_gpu.py tests/gpu/test_logfmt_gpu.py
        ;;
    deepep_tests)
        # DeepEP's own test_intranode.py (4 ranks) and test_low_latency.py (8 ranks, also --use-logfmt), unchanged
        # but for the harness; each script starts and stops MPS per test. Logs: $OUT/deepep_*.log.
        bash tests/gpu/deepep_tests/run_deepep_tests.sh || rc=1
        ;;
    bench) for sub in ll_bench intranode_bench dbo_bench megatron_bench; do "$sub"; done ;;
    ll_bench|ll_phases|intranode_bench|dbo_bench|megatron_bench|internode_bench|megatron_flex|megatron_rows) "$phase" ;;
    internode)
        # Internode engine (NVSHMEM) on virtual nodes of one GPU.
        gpu_tests internode_tests.log "${EP_INTERNODE_TIMEOUT:-420}" tests/gpu/test_internode_gpu.py
        ;;
    side_by_side)
        # The script starts and stops MPS around each of its runs itself.
        timeout "${EP_SBS_TIMEOUT:-300}" bash .deepep/run_side_by_side.sh "${EP_SBS_CONFIGS:-8:16 8:8 4:24}" \
            > "$OUT/side_by_side.log" 2>&1 || rc=1
        grep -v "^\s*$" "$OUT/side_by_side.log" | tail -40
        ;;
    select)
        # shellcheck disable=SC2086  # EP_SELECT is a list of pytest arguments
        gpu_tests select.log "${EP_SELECT_TIMEOUT:-300}" ${EP_SELECT:?set EP_SELECT to pytest arguments}
        ;;
    timeout)
        # Last: the timeout test traps a kernel on purpose.
        gpu_tests timeout_test.log 300 tests/gpu/test_timeout_gpu.py
        ;;
    *) echo "unknown phase $phase"; rc=1 ;;
    esac
    phase_end "$phase"
done
exit $rc
