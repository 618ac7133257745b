"""Per-kernel timeline of the low-latency pair replayed from a CUDA graph (torch.profiler / CUPTI), on every rank.

    python benchmarks/profile_low_latency.py --ranks 8 --sweep 1,128      # one GPU: run under MPS

Shape as bench_low_latency.py (hidden 7168, top-8 of 256, FP8 dispatch, BF16 combine). Prints, per token count, the
time per pair on each rank (the median gap between consecutive dispatches), the median duration of each kernel (rank
0, then every rank), and the last pair's kernels on rank 0 as (name, start µs, duration µs): the gaps between kernels
are launch cost, the durations the work and the waits inside each kernel.

``--max-tokens N``: the calls reserve N tokens per rank (the receive slots' stride) whatever the token count, to see
whether the spread of the writes costs time.

``--phase-trace``: the kernels also stamp the GPU's global timer at each phase of each block (plan, peer waits, rows
moved, arrival, signals; ``csrc/kernels/low_latency.cuh``, TracePoint), and the last pair's stamps are printed per
kernel (median and slowest block of each phase) and for every rank on the GPU's one clock.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
from typing import Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ep_dispatcher import _C  # noqa: E402
from ep_dispatcher.launch import spawn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_low_latency import _routing, rank_setup, shape_parser  # noqa: E402

PAIRS_PER_GRAPH = 4
PROFILED_REPLAYS = 4
TRACE_KERNELS = ("send", "receive", "combine send", "reduce")
TRACE_PHASES = ("plan or acks", "peer wait", "rows", "arrival", "signals")  # between consecutive TracePoints


# The kernel each dispatch starts with: its send, or with EP_DISPATCHER_PENDING_KERNELS=1 and no hook, the whole call.
DISPATCH_FIRST_KERNELS = ("send_tokens_kernel", "send_and_receive_kernel")


def short_kernel_name(name: str) -> str:
    """A kernel's own name (``send_tokens_kernel``): kernels in an anonymous namespace carry a long mangled prefix,
    the same for every kernel of a file, so a cut-off name does not tell them apart. In a mangled name an identifier
    is preceded by its length; a demangled one is matched as it stands."""
    for match in re.finditer(r"_kernel", name):
        end = match.end()
        for start in range(end - len("_kernel"), 0, -1):
            length = str(end - start)
            if name[start - len(length) : start] == length and (name[start].isalpha() or name[start] == "_"):
                return name[start:end]
    found = re.findall(r"(\w+_kernel)", name)
    return found[-1] if found else name[:48]


def _phase_summary(stamps: torch.Tensor) -> Dict:
    """One kernel's stamps [blocks, points] (ns, 0: not reached) -> its span on the global clock and, per phase, the
    median and slowest block (µs). The graph replays several pairs and each overwrites the stamps its blocks reach,
    so a block that signalled in an earlier pair but not in the last keeps an older stamp at that point: a point
    counts as reached only when its stamp is not older than the point before it."""
    started = stamps[stamps[:, 0] > 0]
    if started.numel() == 0:
        return {}
    phases = {}
    for p, name in enumerate(TRACE_PHASES, start=1):
        reached = started[(started[:, p] > 0) & (started[:, p] >= started[:, p - 1])]
        if reached.numel():
            d = (reached[:, p] - reached[:, p - 1]).double() / 1e3
            phases[name] = (float(d.median()), float(d.max()), int(reached.size(0)))
    return {
        "start_ns": int(started[:, 0].min()),
        "end_ns": int(started.max()),
        "blocks": int(started.size(0)),
        "phases": phases,
    }


def _rank_main(rank: int, world: int, args) -> List[Dict]:
    device, sweep, buffer = rank_setup(rank, world, args, max_tokens=args.max_tokens, timeout_s=30)
    hidden, experts, topk = args.hidden, args.experts, args.topk
    trace = None
    if args.phase_trace:  # set before any capture: a graph keeps the kernels' arguments
        trace = torch.zeros(_C.low_latency_trace_shape, dtype=torch.int64, device=device)
        buffer._backend.ll.set_phase_trace(trace)
    rows = {}
    for tokens in sweep:
        x, topk_idx, topk_weights = _routing(rank, tokens, hidden, experts, topk, device)

        def pair():
            handle = buffer.low_latency_dispatch(x, topk_idx, max(tokens, args.max_tokens), experts, use_fp8=True)[2]
            y = buffer.get_next_low_latency_combine_buffer(handle)
            buffer.low_latency_combine(y, topk_idx, topk_weights, handle, zero_copy=True)

        pair()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(PAIRS_PER_GRAPH):
                pair()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        dist.barrier()
        graph.replay()  # absorbs the ranks' start skew (as bench_low_latency's steady state)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILED_REPLAYS):
                graph.replay()
            torch.cuda.synchronize()
        kernels = sorted(
            (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
            key=lambda e: e.time_range.start,
        )
        # The profiled replays' kernels only, from the send of their first pair on: the profiler also reports kernels
        # from before its window (8 ranks: up to 0.8 s earlier).
        pairs = PAIRS_PER_GRAPH * PROFILED_REPLAYS
        send_starts = [e.time_range.start for e in kernels if short_kernel_name(e.name) in DISPATCH_FIRST_KERNELS]
        if len(send_starts) > pairs:
            kernels = [e for e in kernels if e.time_range.start >= send_starts[-pairs]]
        t0 = kernels[0].time_range.start if kernels else 0
        timeline = [(short_kernel_name(e.name), e.time_range.start - t0, e.time_range.elapsed_us()) for e in kernels]
        # The profiler's times count from its own start; its trace start (host clock, shared by the ranks' processes)
        # puts every rank's kernels on one axis.
        results = getattr(prof.profiler, "kineto_results", None)
        origin = results.trace_start_ns() / 1e3 if results is not None and hasattr(results, "trace_start_ns") else None
        durations: Dict[str, List[float]] = {}
        for name, _, duration in timeline:
            durations.setdefault(name, []).append(duration)
        phases = []
        if trace is not None:  # the graph's last pair: zeroed, one more replay
            trace.zero_()
            graph.replay()
            torch.cuda.synchronize()
            stamps = trace.cpu()
            phases = [_phase_summary(stamps[k]) for k in range(len(TRACE_KERNELS))]
        rows[tokens] = dict(
            phases=phases,
            time_per_pair=pair_period_us(send_starts[-pairs:]),
            median={name: statistics.median(d) for name, d in durations.items()},
            last_pair=timeline[-len(timeline) // pairs :] if timeline else [],
            last_pair_host_clock=[
                (name, origin + t0 + start, duration) for name, start, duration in timeline[-len(timeline) // pairs :]
            ]
            if timeline and origin is not None
            else [],
        )
        del graph
    gathered: List = [None] * world
    dist.all_gather_object(gathered, rows)
    buffer.destroy()
    return gathered


def _print_cross_rank(per_rank: List, tokens: int) -> None:
    """Every rank's kernels of the last pair on one time axis (µs from the earliest start): which rank starts each
    phase last, and how long the others' kernels wait for it."""
    pairs = [r[tokens]["last_pair_host_clock"] for r in per_rank]
    if not all(pairs):
        return
    origin = min(start for pair in pairs for _, start, _ in pair)
    print("   last pair on every rank (start-end µs from the earliest kernel start, host clock):")
    for rank, pair in enumerate(pairs):
        cells = "  ".join(
            f"{name.replace('_kernel', '')} {start - origin:.0f}-{start - origin + d:.0f}" for name, start, d in pair
        )
        print(f"     rank {rank}: {cells}")


def _print_phases(per_rank: List, tokens: int) -> None:
    """The phase stamps of the last pair: each kernel's span on every rank (the GPU's global timer, which every rank
    on the GPU shares), and rank 0's phases (median / slowest block)."""
    if not per_rank[0][tokens]["phases"]:
        return
    origin = min(k["start_ns"] for r in per_rank for k in r[tokens]["phases"] if k)
    print("   phase trace, last pair: each kernel's first start - last stamp, µs from the earliest (global timer):")
    for rank, r in enumerate(per_rank):
        cells = "  ".join(
            f"{name} {(k['start_ns'] - origin) / 1e3:.1f}-{(k['end_ns'] - origin) / 1e3:.1f}"
            for name, k in zip(TRACE_KERNELS, r[tokens]["phases"])
            if k
        )
        print(f"     rank {rank}: {cells}")
    print("   rank 0 phases, µs (median / slowest block, blocks that reached it):")
    for name, k in zip(TRACE_KERNELS, per_rank[0][tokens]["phases"]):
        if k:
            cells = "  ".join(f"{p} {m:.1f}/{mx:.1f} ({n})" for p, (m, mx, n) in k["phases"].items())
            print(f"     {name:12s} {k['blocks']:4d} blocks: {cells}")


def pair_period_us(send_starts: List[float]) -> float:
    """Time per pair in steady state: the median gap between consecutive dispatch sends. A median, not (last end -
    first start) / pairs: that figure doubled whenever the profiler mixed in a kernel from before its window or
    dropped one (run X1: 430 µs on seven ranks, 229 on the eighth); a stray gap barely moves a median."""
    gaps = sorted(b - a for a, b in zip(send_starts, send_starts[1:]))
    return statistics.median(gaps) if gaps else 0.0


def main(argv=None) -> int:
    parser = shape_parser(__doc__, "1,128")
    parser.add_argument("--phase-trace", action="store_true", help="stamp and print each kernel's phases")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        help="num_max_dispatch_tokens_per_rank when larger than the token count: it sets the receive slots' stride, "
        "so the same tokens' writes spread over more memory",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    per_rank = spawn(_rank_main, args.ranks, args, backend="gloo")[0]
    for tokens in per_rank[0]:
        periods = [round(r[tokens]["time_per_pair"], 1) for r in per_rank]
        reserved = f" ({args.max_tokens} reserved)" if args.max_tokens > tokens else ""
        print(f"== {args.ranks} ranks, {tokens} tokens{reserved}: time per pair on each rank (µs): {periods}")
        for name, duration in per_rank[0][tokens]["median"].items():
            everyone = [round(r[tokens]["median"].get(name, 0.0), 1) for r in per_rank]
            print(f"   {name:48s} median {duration:7.1f} µs on rank 0; every rank: {everyone}")
        print("   rank 0, last pair (name, start µs, duration µs):")
        for name, start, duration in per_rank[0][tokens]["last_pair"]:
            print(f"     {name:48s} {start:9.1f} {duration:7.1f}")
        _print_cross_rank(per_rank, tokens)
        _print_phases(per_rank, tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
