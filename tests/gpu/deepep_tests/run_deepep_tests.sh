#!/usr/bin/env bash
# Run DeepEP v1.2.1's OWN tests against ep_dispatcher on one GPU (issue 20).
#
# DeepEP's tests/test_intranode.py, test_low_latency.py, test_internode.py and utils.py are copied at run time into a
# temp dir (never committed here); the only change is harness_overrides.py appended to that copy of utils.py
# (init_dist -> gloo on cuda:0, host-staged gloo collectives, bench_kineto by CUDA events). `import deep_ep` resolves
# to ep_dispatcher through a `deep_ep` shim package on PYTHONPATH that calls ep_dispatcher.install_as_deep_ep().
# Their assertions are not touched. Each test runs in its own MPS session.
#
# Usage: bash tests/gpu/deepep_tests/run_deepep_tests.sh [intranode] [low_latency] [logfmt] [internode]
#   default: intranode low_latency logfmt (internode is opt-in: 16 ranks on one GPU, see README.md here).
# Env: DEEPEP_TESTS_DIR (DeepEP's tests/ dir; default .deepep/DeepEP/tests, else extracted from
#   shared/anchor/deepep-v1.2.1.tar.gz or ../shared/anchor/...), OUT (logs, default /tmp/ep_out),
#   DEEPEP_TEST_TIMEOUT (s per test, default 900), DEEPEP_INTERNODE_ARGS (extra args for test_internode.py).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never use NVLink multicast
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo  # one GPU, no NIC (DESIGN.md 5)
export PYTHONUNBUFFERED=1
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
OUT=${OUT:-/tmp/ep_out}; mkdir -p "$OUT"
TESTS=${*:-intranode low_latency logfmt}
TIMEOUT=${DEEPEP_TEST_TIMEOUT:-900}

WORK=$(mktemp -d /tmp/deepep_tests.XXXXXX)
SRC=${DEEPEP_TESTS_DIR:-}
if [ -z "$SRC" ] && [ -f "$ROOT/.deepep/DeepEP/tests/test_intranode.py" ]; then SRC="$ROOT/.deepep/DeepEP/tests"; fi
if [ -z "$SRC" ]; then
    for tarball in "$ROOT/shared/anchor/deepep-v1.2.1.tar.gz" "$ROOT/../shared/anchor/deepep-v1.2.1.tar.gz"; do
        if [ -f "$tarball" ]; then
            tar xzf "$tarball" -C "$WORK" DeepEP/tests && SRC="$WORK/DeepEP/tests" && break
        fi
    done
fi
[ -n "$SRC" ] || { echo "DeepEP's tests not found: set DEEPEP_TESTS_DIR"; exit 2; }
for f in test_intranode.py test_low_latency.py test_internode.py utils.py; do cp "$SRC/$f" "$WORK/$f"; done
cat "$HERE/harness_overrides.py" >> "$WORK/utils.py"
mkdir -p "$WORK/shim/deep_ep"
cp "$HERE/deep_ep_shim.py" "$WORK/shim/deep_ep/__init__.py"
export PYTHONPATH="$WORK/shim:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
echo "DeepEP tests from $SRC, run in $WORK"
python3 -c 'import deep_ep, ep_dispatcher; assert deep_ep is ep_dispatcher; print("deep_ep ->", deep_ep.__file__)' || exit 2

start_mps() {
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps_log
    mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
    nvidia-cuda-mps-control -d && sleep 1
}
stop_mps() { echo quit | nvidia-cuda-mps-control 2>/dev/null; sleep 1; }

rc=0
# launch LOG COMMAND...: run in the background as its own process group (setsid), so that everything it spawned can
# be ended by that group's id afterwards; sets LAUNCHED to its pid (= group id).
launch() {
    local log=$1; shift
    (cd "$WORK" && exec setsid timeout "$TIMEOUT" "$@") > "$log" 2>&1 &
    LAUNCHED=$!
}
finish() {  # finish PID: wait for it, end what is left of its group, return its status
    wait "$1"; local status=$?
    kill -9 -- "-$1" 2>/dev/null
    return $status
}
run_one() {  # run_one NAME COMMAND...
    local name=$1; shift
    echo "=== deepep $name: $* ($(date +%T))"
    start_mps
    MASTER_PORT=$((20000 + RANDOM % 20000)) launch "$OUT/deepep_$name.log" "$@"
    finish "$LAUNCHED"; local status=$?
    stop_mps
    tail -25 "$OUT/deepep_$name.log"
    echo "=== deepep $name: exit $status"
    [ $status -eq 0 ] || rc=1
}

for t in $TESTS; do
    case $t in
    intranode) run_one intranode python3 "$WORK/test_intranode.py" --num-processes 4 ;;  # DeepEP's default shape
    low_latency) run_one low_latency python3 "$WORK/test_low_latency.py" --num-processes 8 ;;
    logfmt) run_one low_latency_logfmt python3 "$WORK/test_low_latency.py" --num-processes 8 --use-logfmt ;;
    internode)
        # Two virtual nodes of 8 ranks on one GPU (DeepEP's test requires 8 local ranks and > 8 ranks): two launches,
        # RANK = node, sharing MASTER_PORT. Our internode engine sizes itself from num_rdma_bytes (the test passes 1e9),
        # see README.md here for the token count that fits.
        export MASTER_PORT=$((20000 + RANDOM % 20000)) WORLD_SIZE=2
        export EP_DISPATCHER_TIMEOUT_S=${EP_DISPATCHER_TIMEOUT_S:-30}
        echo "=== deepep internode ($(date +%T))"
        start_mps
        RANK=0 launch "$OUT/deepep_internode_node0.log" python3 "$WORK/test_internode.py" --num-processes 8 \
            ${DEEPEP_INTERNODE_ARGS:-}
        p0=$LAUNCHED
        RANK=1 launch "$OUT/deepep_internode_node1.log" python3 "$WORK/test_internode.py" --num-processes 8 \
            ${DEEPEP_INTERNODE_ARGS:-}
        p1=$LAUNCHED
        finish "$p0"; s0=$?
        finish "$p1"; s1=$?
        unset WORLD_SIZE MASTER_PORT
        stop_mps
        tail -25 "$OUT/deepep_internode_node0.log"
        echo "=== deepep internode: exit $s0 / $s1"
        [ $s0 -eq 0 ] && [ $s1 -eq 0 ] || rc=1
        ;;
    *) echo "unknown test $t"; rc=1 ;;
    esac
done
exit $rc
