"""Low-latency CUDA engine (NVSHMEM) vs the reference backend, with N ranks sharing the GPU(s).

Each rank runs the same calls on a ``backend="cuda"`` buffer and a ``backend="reference"`` buffer and compares:
``recv_count``, the received rows (FP8 bytes and scales) of every valid slot, ``src_info`` and ``layout_range``
of the handle, and the combined output, all bit for bit (the kernels keep the reference's slot order and its
fp32 summation order). Slots past ``recv_count`` are unspecified and not compared; outputs are allocated over
poisoned memory so that a slot the kernels forgot cannot pass with stale data.

Needs NVSHMEM (``_C.has_nvshmem()``) and, with several ranks on one GPU, MPS (tests/gpu/run_device.sh).
"""

from __future__ import annotations

import faulthandler
import os
import sys

import pytest
import torch

from tests import reference_cases as rc
from ep_dispatcher.launch import use_nvshmem_on_one_machine
from tests.dist import run
from tests.gpu.common import WORLDS, WORLDS_AND_ONE, require_extension, set_device, where_differs
from tests.poison import poison_allocator

pytestmark = pytest.mark.gpu
_C = require_extension(nvshmem=True)

from ep_dispatcher import Buffer  # noqa: E402

# Kernel names as the profiler reports them, mangled or not (the low-latency profiler's helper).
BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")
sys.path.insert(0, BENCHMARKS)
from profile_low_latency import short_kernel_name  # noqa: E402

# (max_tokens, hidden, experts per rank, top-k): the decode shape, a small one, and a hidden that is a multiple
# of 128 but not of 256 (the FP8 cast's second half-warp idles) nor of 512 (no UE8M0).
SHAPES = [(128, 7168, None, 8), (32, 2048, 4, 4), (16, 640, 3, 3)]
POISON_BYTES = 256 << 20
SEEDS = [int(s) for s in os.environ.get("EP_LL_TEST_SEEDS", "1,2").split(",")]
TIMEOUT_S = float(os.environ.get("EP_LL_TEST_TIMEOUT_S", "20"))  # kernel waits: a lost signal fails fast


VERBOSE = os.environ.get("EP_LL_TEST_VERBOSE") == "1"


# A rank stuck on the host (e.g. in an NVSHMEM barrier after a peer failed) prints its stacks and exits once this long
# has passed without progress: every _log call re-arms the timer, so it bounds one step, not a worker's whole life.
STACKS_AFTER_S = float(os.environ.get("EP_LL_TEST_STACKS_AFTER_S", "120"))


def _restart_stack_timer() -> None:
    faulthandler.dump_traceback_later(STACKS_AFTER_S, exit=True, file=sys.stderr)  # replaces a running timer


def _log(*parts) -> None:
    _restart_stack_timer()
    if VERBOSE:
        print(f"[rank {torch.distributed.get_rank()}]", *parts, flush=True)


def _env() -> None:
    _restart_stack_timer()
    use_nvshmem_on_one_machine()  # one GPU, no NIC (DESIGN.md section 5)


def _num_experts(world: int, per_rank) -> int:
    return 256 if per_rank is None else per_rank * world


def _buffers(world: int, allow_nvlink: bool = True, shapes=SHAPES):
    _env()
    set_device(torch.distributed.get_rank())
    size = max(Buffer.get_low_latency_rdma_size_hint(t, h, world, _num_experts(world, e)) for t, h, e, _ in shapes)
    cuda = Buffer(
        None,
        low_latency_mode=True,
        num_rdma_bytes=size,
        backend="cuda",
        allow_nvlink_for_low_latency_mode=allow_nvlink,
        timeout_s=TIMEOUT_S,
    )
    _log("cuda buffer ready, direct peers:", cuda._backend.ll.num_direct_peers if cuda._backend.ll else None)
    ref = Buffer(None, low_latency_mode=True, num_rdma_bytes=size, backend="reference")
    assert "low_latency_dispatch" in cuda.engine_calls and "low_latency_combine" in cuda.engine_calls
    return cuda, ref


def _case(seed: int, world: int, max_tokens: int, hidden: int, per_rank, topk: int) -> rc.Case:
    g = torch.Generator().manual_seed(seed)
    tokens = [int(torch.randint(0, max_tokens + 1, (1,), generator=g)) for _ in range(world)]
    tokens[seed % world] = max_tokens  # exactly num_max_dispatch_tokens_per_rank
    if world > 1:
        tokens[(seed + 1) % world] = 0  # a rank with nothing to send
    return rc.Case(
        seed=seed,
        num_ranks=world,
        num_experts=_num_experts(world, per_rank),
        num_topk=topk,
        hidden=hidden,
        tokens_per_rank=tokens,
        minus_one_fraction=(0.0, 0.1, 0.3)[seed % 3],
        skewed=bool(seed % 2),
    )


def _expert_outputs(seed: int, rank: int, shape, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7 + rank)
    return (torch.randn(shape, generator=g) * 2).to(torch.bfloat16).to(device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _compare_dispatch(errors, tag, out_c, out_r, use_fp8) -> list:
    recv_c, count_c, handle_c = out_c[:3]
    recv_r, count_r, handle_r = out_r[:3]
    torch.cuda.synchronize()
    if not torch.equal(count_c, count_r):
        errors.append(f"{tag}: recv_count {count_c.tolist()} != {count_r.tolist()}")
        return count_r.tolist()
    data_c, scales_c = recv_c if use_fp8 else (recv_c, None)
    data_r, scales_r = recv_r if use_fp8 else (recv_r, None)
    counts = count_r.tolist()
    for e, n in enumerate(counts):
        if not torch.equal(_bytes(data_c[e, :n]), _bytes(data_r[e, :n])):
            errors.append(f"{tag}: expert {e} data")
        if scales_c is not None and not torch.equal(scales_c[e, :n], scales_r[e, :n]):
            errors.append(f"{tag}: expert {e} scales")
    if not torch.equal(handle_c.src_info, handle_r.src_info):
        errors.append(f"{tag}: src_info")
    if not torch.equal(handle_c.layout_range, handle_r.layout_range):
        errors.append(f"{tag}: layout_range")
    return counts


def _modes(hidden: int):
    modes = [dict(use_fp8=False), dict(use_fp8=True), dict(use_fp8=True, round_scale=True)]
    if hidden % 512 == 0:
        modes.append(dict(use_fp8=True, round_scale=True, use_ue8m0=True))
    return modes


def _compare_worker(rank: int, world: int, seeds, allow_nvlink: bool, shapes=SHAPES, max_blocks=None) -> list:
    if max_blocks is not None:  # read when the buffer is made
        os.environ["EP_DISPATCHER_LL_MAX_BLOCKS"] = str(max_blocks)
    cuda, ref = _buffers(world, allow_nvlink, shapes)
    device = torch.device("cuda", torch.cuda.current_device())
    if not allow_nvlink:
        assert cuda._backend.ll.num_direct_peers == 0, "allow_nvlink_for_low_latency_mode=False must use NVSHMEM puts"
    errors: list = []
    for shape_index, (max_tokens, hidden, per_rank, topk) in enumerate(shapes):
        for seed in seeds:
            case = _case(seed * 10 + shape_index, world, max_tokens, hidden, per_rank, topk)
            E = case.num_experts
            x, topk_idx, topk_weights = (t.to(device) for t in rc.rank_inputs(case, rank))
            stats_c = torch.zeros(E // world, dtype=torch.int32, device=device)
            stats_r = torch.zeros_like(stats_c)
            for mode_index, mode in enumerate(_modes(hidden)):
                tag = f"rank {rank} seed {seed} shape {(max_tokens, hidden, E, topk)} {mode}"
                hooked = (seed + mode_index) % 2 == 1
                _log(tag, "hooked" if hooked else "one-shot")
                poison_allocator(POISON_BYTES, device)
                out_c = cuda.low_latency_dispatch(
                    x,
                    topk_idx,
                    max_tokens,
                    E,
                    return_recv_hook=hooked,
                    cumulative_local_expert_recv_stats=stats_c,
                    **mode,
                )
                if hooked:
                    out_c[4]()
                out_r = ref.low_latency_dispatch(
                    x, topk_idx, max_tokens, E, cumulative_local_expert_recv_stats=stats_r, **mode
                )
                _compare_dispatch(errors, tag, out_c, out_r, mode["use_fp8"])
                _log("dispatch compared, errors so far:", len(errors))

                # Combine: the same expert outputs on both; zero-copy and out= on alternate calls.
                y = _expert_outputs(seed + mode_index, rank, (E // world, world * max_tokens, hidden), device)
                zero_copy = mode_index % 2 == 1
                x_c = y
                if zero_copy:
                    x_c = cuda.get_next_low_latency_combine_buffer(out_c[2])
                    x_c.copy_(y)
                out = torch.full((x.size(0), hidden), float("nan"), dtype=torch.bfloat16, device=device)
                comb_c, event, hook = cuda.low_latency_combine(
                    x_c,
                    topk_idx,
                    topk_weights,
                    out_c[2],
                    zero_copy=zero_copy,
                    return_recv_hook=not hooked,
                    out=out,
                    async_finish=hooked,
                )
                if not hooked:
                    hook()
                else:
                    event.current_stream_wait()
                comb_r, _, _ = ref.low_latency_combine(y, topk_idx, topk_weights, out_r[2])
                torch.cuda.synchronize()
                if comb_c.data_ptr() != out.data_ptr():
                    errors.append(f"{tag}: combine ignored out=")
                if not torch.equal(comb_c, comb_r):
                    diff = (comb_c.float() - comb_r.float()).abs().nan_to_num(float("inf")).max().item()
                    errors.append(f"{tag}: combine zero_copy={zero_copy} max diff {diff}")
            if not torch.equal(stats_c, stats_r):
                errors.append(f"rank {rank} seed {seed}: cumulative stats {stats_c.tolist()} != {stats_r.tolist()}")
    cuda.destroy()
    return errors


def _raise(results) -> None:
    errors = [e for per_rank in results for e in per_rank]
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("world", WORLDS_AND_ONE)
def test_low_latency_matches_reference(world):
    _raise(run(_compare_worker, world, SEEDS, True))


# One block budget: the send kernel's four blocks then plan 33 to 64 tokens each, in several 32-token windows, and the
# receive and sum kernels loop over many items per thread.
FEW_BLOCK_SHAPES = [(256, 640, 3, 3), (128, 7168, None, 8)]


@pytest.mark.parametrize("world", WORLDS[:1])
def test_low_latency_matches_reference_with_one_block_budget(world):
    _raise(run(_compare_worker, world, SEEDS, True, FEW_BLOCK_SHAPES, 1))


LOW_LATENCY_KERNELS = (
    "send_tokens_kernel",
    "receive_tokens_kernel",
    "send_outputs_kernel",
    "reduce_outputs_kernel",
    "send_and_receive_kernel",
    "send_and_reduce_kernel",
)


def _kernels_per_call_worker(rank: int, world: int) -> list:
    """The CUDA kernels each low-latency call launches (names from the profiler), hooked and one-shot."""
    max_tokens, hidden, per_rank, topk = SHAPES[1]
    cuda, _ = _buffers(world, shapes=[SHAPES[1]])
    device = torch.device("cuda", torch.cuda.current_device())
    case = _case(5, world, max_tokens, hidden, per_rank, topk)
    x, idx, w = (t.to(device) for t in rc.rank_inputs(case, rank))
    E = case.num_experts
    launched = {}
    for hooked in (True, False, True, False):  # twice each: the second pair runs warm
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            _, _, handle, _, hook = cuda.low_latency_dispatch(x, idx, max_tokens, E, return_recv_hook=hooked)
            if hooked:
                hook()
            y = cuda.get_next_low_latency_combine_buffer(handle)
            y.zero_()  # a kernel of its own, filtered out below
            _, _, hook = cuda.low_latency_combine(y, idx, w, handle, zero_copy=True, return_recv_hook=hooked)
            if hooked:
                hook()
            torch.cuda.synchronize()
        names = [short_kernel_name(e.name) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        launched[hooked] = sorted(name for name in names if name in LOW_LATENCY_KERNELS)
    cuda.destroy()
    return [launched]


@pytest.mark.parametrize("world", [1, 2])
def test_low_latency_kernels_per_call(world):
    """Pins which kernels a call launches, so that a path silently not taken fails here rather than only in the
    figures: with EP_DISPATCHER_PENDING_KERNELS=1 a one-shot call is one kernel per phase pair at several ranks, and one
    rank alone runs one kernel per dispatch and per zero-copy combine, hooked or not (docs/low_latency.md)."""
    pending = _C.pending_kernels_enabled()
    split = ["receive_tokens_kernel", "reduce_outputs_kernel", "send_outputs_kernel", "send_tokens_kernel"]
    if world == 1 and pending:
        expected = {True: ["reduce_outputs_kernel", "send_tokens_kernel"]}
        expected[False] = expected[True]
    elif pending:
        expected = {True: split, False: ["send_and_receive_kernel", "send_and_reduce_kernel"]}
    else:
        expected = {True: split, False: split}
    for launched in (r[0] for r in run(_kernels_per_call_worker, world)):
        assert launched == expected, f"pending kernels {pending}: launched {launched}, expected {expected}"


GRAPH_SHAPE = (64, 2048, 4, 4)


def _graph_worker(rank: int, world: int, seeds, hooked: bool = True) -> list:
    max_tokens, hidden, per_rank, topk = GRAPH_SHAPE
    cuda, ref = _buffers(world, shapes=[GRAPH_SHAPE])
    device = torch.device("cuda", torch.cuda.current_device())
    E = per_rank * world
    static_x = torch.empty((max_tokens, hidden), dtype=torch.bfloat16, device=device)
    static_idx = torch.empty((max_tokens, topk), dtype=torch.int64, device=device)
    static_w = torch.empty((max_tokens, topk), dtype=torch.float32, device=device)

    def load(seed: int):
        case = _case(seed, world, max_tokens, hidden, per_rank, topk)
        case.tokens_per_rank = [max_tokens] * world  # a graph has fixed shapes
        x, idx, w = (t.to(device) for t in rc.rank_inputs(case, rank))
        static_x.copy_(x)
        static_idx.copy_(idx)
        static_w.copy_(w)
        return x, idx, w

    def step(x, idx, w, buffer, hooked):
        (data, scales), count, handle, _, hook = buffer.low_latency_dispatch(
            x, idx, max_tokens, E, use_fp8=True, return_recv_hook=hooked
        )
        if hooked:
            hook()
        y = (data.float() * scales[:, :, :1]).to(torch.bfloat16)  # any function of the received rows
        out, _, hook = buffer.low_latency_combine(y, idx, w, handle, return_recv_hook=hooked)
        if hooked:
            hook()
        return data, count, out

    errors: list = []
    load(seeds[0])
    step(static_x, static_idx, static_w, cuda, hooked)  # eager warm-up: the buffer is laid out for this shape
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_data, g_count, g_out = step(static_x, static_idx, static_w, cuda, hooked)
    for seed in seeds:
        _log("graph replay, seed", seed)
        x, idx, w = load(seed)
        poison_allocator(POISON_BYTES, device)
        graph.replay()
        torch.cuda.synchronize()
        data_r, count_r, out_r = step(x, idx, w, ref, False)
        if not torch.equal(g_count, count_r):
            errors.append(f"rank {rank} graph seed {seed}: recv_count {g_count.tolist()} != {count_r.tolist()}")
            continue
        for e, n in enumerate(count_r.tolist()):
            got, expected = _bytes(g_data[e, :n]), _bytes(data_r[e, :n])
            if not torch.equal(got, expected):
                errors.append(f"rank {rank} graph seed {seed}: expert {e} data ({where_differs(got, expected)})")
        if not torch.equal(g_out, out_r):
            errors.append(f"rank {rank} graph seed {seed}: combined output ({where_differs(g_out, out_r)})")
    cuda.destroy()
    return errors


@pytest.mark.parametrize("hooked", [True, False], ids=["hooked", "one-shot"])  # one-shot: one kernel per call, pending
@pytest.mark.parametrize("world", WORLDS_AND_ONE)
def test_low_latency_cuda_graph_replay_with_new_inputs(world, hooked):
    _raise(run(_graph_worker, world, [11, 12, 13], hooked))


def _stress_worker(rank: int, world: int, iterations: int) -> list:
    """Two calls in flight on the two buffer halves, hooks run in either order, routings change every step."""
    max_tokens, hidden, per_rank, topk = 32, 1024, 4, 4
    cuda, ref = _buffers(world, shapes=[(max_tokens, hidden, per_rank, topk)])
    device = torch.device("cuda", torch.cuda.current_device())
    E = per_rank * world
    errors: list = []
    for it in range(iterations):
        _log("stress iteration", it)
        cases = [_case(1000 + 2 * it + j, world, max_tokens, hidden, per_rank, topk) for j in range(2)]
        inputs = [[t.to(device) for t in rc.rank_inputs(c, rank)] for c in cases]
        outs = [
            cuda.low_latency_dispatch(x, idx, max_tokens, E, use_fp8=False, return_recv_hook=True)
            for x, idx, _ in inputs
        ]
        for j in (0, 1) if it % 2 else (1, 0):
            outs[j][4]()
        for j, (x, idx, _) in enumerate(inputs):
            ref_out = ref.low_latency_dispatch(x, idx, max_tokens, E, use_fp8=False)
            _compare_dispatch(errors, f"rank {rank} iteration {it} call {j}", outs[j], ref_out, False)
        if errors:
            break
    cuda.destroy()
    return errors


@pytest.mark.parametrize("world", WORLDS[-1:])
def test_low_latency_back_to_back_two_in_flight(world):
    _raise(run(_stress_worker, world, int(os.environ.get("EP_GPU_STRESS_ITERS", "100"))))


@pytest.mark.parametrize("world", [w for w in WORLDS if w > 1][-1:])
def test_low_latency_over_nvshmem_puts(world):
    """``allow_nvlink_for_low_latency_mode=False``: every transfer is an NVSHMEM put + signal (the RDMA path)."""
    _raise(run(_compare_worker, world, [3], False))


# A receive wait lasts at most the kernel timeout; clock64 runs below 3 GHz on every GPU we build for.
MAX_CYCLES_PER_WAIT = int(TIMEOUT_S * 3e9)


def _wait_stats_worker(rank: int, world: int) -> list:
    """dispatch/combine_wait_recv_cost_stats: the receive kernels add, per source rank, the clock64 cycles they spun.
    Checked: one-shot, hooked (added by the hook's kernel, not by the send phase) and CUDA-graph replays; every entry
    stays >= 0, grows monotonically, and is > 0 for every source after a call (one timed wait per (local expert,
    source) count in dispatch and per expert flag in combine, and a timed wait always spans at least one load); the
    words around the tensor are not touched; None works; the outputs still equal the reference."""
    max_tokens, hidden, per_rank, topk = 32, 1024, 4, 4
    cuda, ref = _buffers(world, shapes=[(max_tokens, hidden, per_rank, topk)])
    device = torch.device("cuda", torch.cuda.current_device())
    E = per_rank * world
    sentinel = -(2**62)
    # Each stats tensor is the middle of a guarded run: the kernels must add to exactly [world] int64 words.
    guarded = {name: torch.full((world + 2,), sentinel, dtype=torch.int64, device=device) for name in ("d", "c")}
    for g in guarded.values():
        g[1:-1].zero_()
    stats = {name: g[1:-1] for name, g in guarded.items()}
    errors: list = []
    history = {"d": [torch.zeros(world, dtype=torch.int64)], "c": [torch.zeros(world, dtype=torch.int64)]}

    def check(tag: str, grew: tuple) -> None:
        torch.cuda.synchronize()
        for name, g in guarded.items():
            if g[0].item() != sentinel or g[-1].item() != sentinel:
                errors.append(f"rank {rank} {tag}: {name} stats wrote outside [num_ranks]: {g.tolist()}")
            now, before = stats[name].cpu(), history[name][-1]
            if (now < 0).any():
                errors.append(f"rank {rank} {tag}: {name} stats negative {now.tolist()}")
            if (now < before).any():
                errors.append(f"rank {rank} {tag}: {name} stats decreased {before.tolist()} -> {now.tolist()}")
            if name in grew:
                if not (now > before).all():
                    errors.append(
                        f"rank {rank} {tag}: {name} stats did not grow for every source {before.tolist()} -> "
                        f"{now.tolist()}"
                    )
                if ((now - before) > MAX_CYCLES_PER_WAIT * per_rank * 8).any():
                    errors.append(
                        f"rank {rank} {tag}: {name} stats grew implausibly {before.tolist()} -> {now.tolist()}"
                    )
            elif not torch.equal(now, before):
                errors.append(f"rank {rank} {tag}: {name} stats changed {before.tolist()} -> {now.tolist()}")
            history[name].append(now)

    def step(x, idx, w, hooked: bool, with_stats: bool, tag: str, compare: bool = True):
        d_stats = stats["d"] if with_stats else None
        c_stats = stats["c"] if with_stats else None
        out_c = cuda.low_latency_dispatch(
            x, idx, max_tokens, E, dispatch_wait_recv_cost_stats=d_stats, return_recv_hook=hooked, use_fp8=False
        )
        if hooked:
            check(f"{tag} after the dispatch send phase", ())  # only the receive kernel adds
            out_c[4]()
        check(f"{tag} after the dispatch receive", ("d",) if with_stats else ())
        y = _expert_outputs(3, rank, (E // world, world * max_tokens, hidden), device)
        comb_c, _, hook = cuda.low_latency_combine(
            y, idx, w, out_c[2], return_recv_hook=hooked, combine_wait_recv_cost_stats=c_stats
        )
        if hooked:
            check(f"{tag} after the combine send phase", ())
            hook()
        check(f"{tag} after the combine receive", ("c",) if with_stats else ())
        if compare:
            out_r = ref.low_latency_dispatch(x, idx, max_tokens, E, use_fp8=False)
            _compare_dispatch(errors, f"rank {rank} {tag}", out_c, out_r, False)
            comb_r, _, _ = ref.low_latency_combine(y, idx, w, out_r[2])
            if not torch.equal(comb_c, comb_r):
                errors.append(f"rank {rank} {tag}: combine differs from the reference")

    for it in range(4):
        case = _case(500 + it, world, max_tokens, hidden, per_rank, topk)
        x, idx, w = (t.to(device) for t in rc.rank_inputs(case, rank))
        step(x, idx, w, hooked=it % 2 == 1, with_stats=True, tag=f"call {it}")
        step(x, idx, w, hooked=it % 2 == 0, with_stats=False, tag=f"call {it} without stats")

    # CUDA graph: the stats pointer is captured; each replay adds again.
    case = _case(600, world, max_tokens, hidden, per_rank, topk)
    case.tokens_per_rank = [max_tokens] * world
    x, idx, w = (t.to(device) for t in rc.rank_inputs(case, rank))
    y = _expert_outputs(4, rank, (E // world, world * max_tokens, hidden), device)

    def captured():
        _, _, handle, _, hook = cuda.low_latency_dispatch(
            x, idx, max_tokens, E, use_fp8=False, return_recv_hook=True, dispatch_wait_recv_cost_stats=stats["d"]
        )
        hook()
        out, _, hook = cuda.low_latency_combine(
            y, idx, w, handle, return_recv_hook=True, combine_wait_recv_cost_stats=stats["c"]
        )
        hook()
        return out

    captured()
    check("graph warm-up", ("d", "c"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = captured()
    check("graph capture (nothing runs)", ())
    for replay in range(3):
        graph.replay()
        check(f"graph replay {replay}", ("d", "c"))
    out_r = ref.low_latency_dispatch(x, idx, max_tokens, E, use_fp8=False)
    comb_r, _, _ = ref.low_latency_combine(y, idx, w, out_r[2])
    if not torch.equal(g_out, comb_r):
        errors.append(f"rank {rank}: graph-replayed combine with stats differs from the reference")
    _log("wait stats (cycles) dispatch", stats["d"].tolist(), "combine", stats["c"].tolist())
    cuda.destroy()
    return errors


@pytest.mark.parametrize("world", WORLDS)
def test_low_latency_wait_recv_cost_stats(world):
    _raise(run(_wait_stats_worker, world))


def _expect_one_raise(errors, tag: str, calls, pattern: str, should_raise: bool) -> None:
    """Runs ``calls`` in order (each a collective low-latency call); a bad entry found on the device is raised by the
    call that found it or a later one, so exactly one of them must raise on the rank that passed it, none elsewhere."""
    raised = []
    for call in calls:
        try:
            call()
        except ValueError as e:
            raised.append(str(e))
        torch.cuda.synchronize()  # the kernels have run: the record is there for the next call at the latest
    if should_raise and (len(raised) != 1 or pattern not in raised[0] or "topk_idx" not in raised[0]):
        errors.append(f"{tag}: expected one ValueError naming topk_idx and {pattern!r}, got {raised}")
    if not should_raise and raised:
        errors.append(f"{tag}: unexpected {raised}")


def _bad_ids_worker(rank: int, world: int) -> list:
    """Bad topk_idx entries (out of range, an expert listed twice, in dispatch and in combine) on rank 0: the kernels
    skip them and report them without a host sync; rank 0 raises ValueError from the hook or a later call, nothing
    hangs, and the ranks stay in step (a following dispatch + combine equals the reference)."""
    max_tokens, hidden, per_rank, topk = 32, 1024, 4, 4
    cuda, ref = _buffers(world, shapes=[(max_tokens, hidden, per_rank, topk)])
    device = torch.device("cuda", torch.cuda.current_device())
    E = per_rank * world
    case = _case(77, world, max_tokens, hidden, per_rank, topk)
    case.tokens_per_rank = [max_tokens] * world
    x, idx, w = (t.to(device) for t in rc.rank_inputs(case, rank))
    bad_rank = rank == 0
    out_of_range, repeated = idx.clone(), idx.clone()
    if bad_rank:
        out_of_range[1, 2] = E + 5
        repeated[3, 0] = repeated[3, 1] = 0
    errors: list = []

    # No host sync in any low-latency call (the checks run on the device): a sync inside these calls raises.
    cuda.low_latency_dispatch(x, idx, max_tokens, E, use_fp8=False)  # the buffer takes this shape (a one-time clean)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        recv, _, handle, _, hook = cuda.low_latency_dispatch(x, idx, max_tokens, E, return_recv_hook=True)
        hook()
        y = cuda.get_next_low_latency_combine_buffer(handle)
        y.copy_((recv[0].float() * recv[1][:, :, :1]).to(torch.bfloat16))
        _, _, hook = cuda.low_latency_combine(y, idx, w, handle, zero_copy=True, return_recv_hook=True)
        hook()
        cuda.low_latency_combine(y, idx, w, cuda.low_latency_dispatch(x, idx, max_tokens, E)[2])
    except RuntimeError as e:
        errors.append(f"rank {rank}: a low-latency call synchronised the host: {e}")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()

    def dispatch(ids, **kwargs):
        return lambda: cuda.low_latency_dispatch(x, ids, max_tokens, E, use_fp8=False, **kwargs)

    # Hooked: the send phase has run (synchronized) by the time the hook runs, so the hook raises, unless the GPU was
    # fast enough for the dispatch call itself to see the record (it then runs its own receive and raises).
    hooks = []

    def hooked_dispatch():
        hooks.append(cuda.low_latency_dispatch(x, out_of_range, max_tokens, E, use_fp8=False, return_recv_hook=True)[4])

    def run_hook():
        if hooks:
            hooks.pop()()

    _expect_one_raise(errors, f"rank {rank} out-of-range id, hooked", [hooked_dispatch, run_hook], str(E + 5), bad_rank)
    calls = [dispatch(repeated), dispatch(idx)]
    _expect_one_raise(errors, f"rank {rank} repeated expert", calls, "more than once", bad_rank)

    out_c = cuda.low_latency_dispatch(x, idx, max_tokens, E, use_fp8=False)
    out_r = ref.low_latency_dispatch(x, idx, max_tokens, E, use_fp8=False)
    _compare_dispatch(errors, f"rank {rank} dispatch after bad ids", out_c, out_r, False)
    y = _expert_outputs(5, rank, (E // world, world * max_tokens, hidden), device)
    _expect_one_raise(
        errors,
        f"rank {rank} out-of-range id in combine",
        [lambda: cuda.low_latency_combine(y, out_of_range, w, out_c[2]), dispatch(idx)],
        str(E + 5),
        bad_rank,
    )
    out_c = cuda.low_latency_dispatch(x, idx, max_tokens, E, use_fp8=False)
    comb_c, _, _ = cuda.low_latency_combine(y, idx, w, out_c[2])
    comb_r, _, _ = ref.low_latency_combine(y, idx, w, out_r[2])
    torch.cuda.synchronize()
    if not torch.equal(comb_c, comb_r):
        errors.append(f"rank {rank}: combine after bad ids differs from the reference")
    cuda.destroy()
    return errors


@pytest.mark.parametrize("world", WORLDS_AND_ONE)  # one rank alone has its own kernels (the direct path)
def test_low_latency_bad_topk_idx_raises_without_host_sync(world):
    _raise(run(_bad_ids_worker, world))
