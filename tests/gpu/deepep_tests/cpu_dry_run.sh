#!/usr/bin/env bash
# CPU dry run of DeepEP v1.2.1's own tests' correctness parts against ep_dispatcher's reference backend (gloo), at small
# shapes: a check of the API they call (names, arguments, tuple handles, formats, assertions) on machines without a
# GPU. NOT the GPU run (run_deepep_tests.sh): here the copies are edited beyond the harness, namely device='cuda' ->
# 'cpu', the benchmark/tuning tails cut off (they time CUDA events), and init_dist on CPU. Assertions are untouched.
#
# Usage: bash tests/gpu/deepep_tests/cpu_dry_run.sh   (DEEPEP_TESTS_DIR as in run_deepep_tests.sh)
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
WORK=$(mktemp -d /tmp/deepep_dry.XXXXXX)
SRC=${DEEPEP_TESTS_DIR:-$ROOT/.deepep/DeepEP/tests}
[ -f "$SRC/test_intranode.py" ] || { echo "DeepEP's tests not found: set DEEPEP_TESTS_DIR"; exit 2; }
cp "$SRC"/test_intranode.py "$SRC"/test_low_latency.py "$SRC"/test_internode.py "$SRC"/utils.py "$WORK/"
python3 - "$WORK" "$HERE/harness_overrides.py" <<'PY'
import sys
work, overrides = sys.argv[1], open(sys.argv[2]).read()
def edit(name, pairs):
    path = f"{work}/{name}"
    text = open(path).read()
    for old, new in pairs:
        assert old in text, (name, old)
        text = text.replace(old, new)
    open(path, "w").write(text)
cuda = [("device='cuda'", "device='cpu'")]
edit("utils.py", cuda + [("'backend': 'nccl'", "'backend': 'gloo'"),
                         ("torch.set_default_device('cuda')", "torch.set_default_device('cpu')"),
                         ("torch.cuda.set_device(local_rank)", "pass"),
                         ("params['device_id'] = torch.device(f'cuda:{local_rank}')", "pass")])
# gloo's all_gather_into_tensor refuses DeepEP's [world, n, k] output on CPU too: the harness's list-based one.
start, end = overrides.index("def _ep_host_staged"), overrides.index("def bench_kineto")
open(f"{work}/utils.py", "a").write("\nimport torch.distributed as _ep_dist\n" + overrides[start:end])
layout_bench = ("    t = bench(lambda: buffer.get_dispatch_layout(topk_idx, num_experts))[0]", "    t = 0.0")
edit("test_intranode.py", cuda + [layout_bench, ("    # Tune dispatch performance", "    return\n    # Tune dispatch performance")])
edit("test_internode.py", cuda + [layout_bench, ("    if skip_benchmark:\n        return hash_value", "    return hash_value")])
edit("test_low_latency.py", cuda + [("    # noinspection PyShadowingNames\n    def large_gemm_with_hook",
                                     "    return hash_value\n    # noinspection PyShadowingNames\n    def large_gemm_with_hook")])
PY
mkdir -p "$WORK/shim/deep_ep" && cp "$HERE/deep_ep_shim.py" "$WORK/shim/deep_ep/__init__.py"
export PYTHONPATH="$WORK/shim:$ROOT${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=""
cd "$WORK" || exit 2
rc=0
check() { local name=$1; shift; MASTER_PORT=$((20000 + RANDOM % 20000)) timeout 600 "$@" > "$WORK/$name.log" 2>&1
          local s=$?; echo "$name: exit $s"; [ $s -eq 0 ] || { tail -15 "$WORK/$name.log"; rc=1; }; }
check intranode python3 test_intranode.py --num-processes 4 --num-tokens 256 --hidden 1024 --num-experts 32
check low_latency python3 test_low_latency.py --num-processes 4 --num-tokens 16 --hidden 1024 --num-experts 32
check low_latency_logfmt python3 test_low_latency.py --num-processes 8 --num-tokens 32 --hidden 2048 --num-experts 288 \
    --use-logfmt
# test_internode.py needs 8 local ranks and > 8 ranks: two "nodes" of 8 processes.
port=$((20000 + RANDOM % 20000))
for node in 0 1; do
    MASTER_PORT=$port WORLD_SIZE=2 RANK=$node timeout 600 python3 test_internode.py --num-processes 8 --num-tokens 64 \
        --hidden 1024 --num-experts 32 > "$WORK/internode_$node.log" 2>&1 &
    pids[$node]=$!
done
for node in 0 1; do wait "${pids[$node]}"; s=$?; echo "internode node $node: exit $s"; [ $s -eq 0 ] || { tail -15 "$WORK/internode_$node.log"; rc=1; }; done
echo "logs in $WORK"
exit $rc
