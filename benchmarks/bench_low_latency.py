"""Low-latency (decode) dispatch/combine benchmark: N ranks on the visible GPU(s) (one GPU: run under MPS).

    python benchmarks/bench_low_latency.py --ranks 8                       # 128 tokens/rank, the decode shape
    python benchmarks/bench_low_latency.py --ranks 8 --sweep 1,8,32,64,128,256 --out bench_ll.json

Shape (DESIGN.md section 6): hidden 7168, top-8 of 256 experts, FP8 dispatch, BF16 combine. For each token count
the table shows, per call (median over --groups groups of --calls back-to-back calls, CUDA events):
  - one-shot dispatch and combine (send + receive in one call), eager, alternating as in a decode step, each timed
    by CUDA events around it (the wait for the slowest peer is part of the call's time);
  - the same pair replayed from a CUDA graph (no launch cost): eager - graph is the launch/host overhead; also
    --calls dispatches alone and --calls combines alone (of one dispatch's handle) replayed from graphs (JSON
    "graph_dispatch_us", "graph_combine_us"), and one dispatch and one combine captured in two graphs and replayed
    alternately, timed like the eager calls, for the issue's per-call host share (1 - graph / eager, dispatch and
    combine each; "d host %", "c host %"). The alternating replays are the eager calls' counterpart: the eager combine
    that follows a dispatch waits for the slowest peer's dispatch receive, which combines replayed back to back never
    do, so "1 - combine alone / eager combine" (JSON "combine_host_share_vs_alone") also counts that wait;
Steady state: every timed window (eager group or graph replay) follows an untimed pair or replay issued right after
the host barrier. Its receives wait for every peer's sends, so it absorbs the ranks' start skew (the processes leave
the gloo barrier up to milliseconds apart) and the timed calls run with the ranks in step, as in a decode loop that
replays layer after layer. "graph cold" is the pair replay timed straight after the barrier (the skew, paid once per
--calls pairs, included): the figure this benchmark printed as "graph d+c" before 2026-12-05.
  - with return_recv_hook=True, the send phase and the receive phase separately, GPU time only: the GPU spins
    --gap-us before the send (so the host has enqueued the phases when it starts) and again before each receive
    (so that it measures the receive kernel, not the wait for the slowest peer).
Eager calls are bound by host time when it exceeds the kernels' (Python, argument checks, launches): the graph
column is the GPU time of the pair, and 1 - graph / eager is the share of launch and host overhead.
The CUDA engine checks topk_idx in its kernels (no host sync) whatever --validate-inputs says; the flag only
matters to calls served by the reference implementation.
Bytes in the field's accounting: dispatch = valid (token, expert) entries sent by the rank x (hidden FP8 bytes +
hidden/128 fp32 scales); combine = the same entries x hidden BF16 bytes. The limit on one GPU is the device-to-device
copy bandwidth measured in the same run, and "copy" is the time that copy bandwidth would need for the call's bytes
(read + write); "launch" is the measured cost of one empty kernel launch.
"SM %" is the share of the GPU's SMs one rank's call occupies: its widest kernel's grid in 512-thread block
equivalents (one per SM) over the SM count; "all SM %" is that times the ranks sharing the GPU (their kernels run
at once under MPS).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Callable, Dict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ep_dispatcher import Buffer, settings  # noqa: E402
from ep_dispatcher.launch import spawn, use_nvshmem_on_one_machine  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_intranode import _time_calls, copy_bandwidth_gbps  # noqa: E402

PUBLISHED_US = {"pplx 8xH100": (83.6, 102.3), "DeepEP CX7": (43.0, 72.0)}  # (dispatch, combine) at 128 tokens


def _events(n: int):
    return [torch.cuda.Event(enable_timing=True) for _ in range(n)]


def _median_us(fn: Callable[[], None], calls: int, groups: int) -> float:
    """Median over ``groups`` of the mean time (µs) of ``calls`` back-to-back ``fn()``."""
    return _time_calls(fn, calls, groups) * 1e6


def _alternating_us(first: Callable[[], None], second: Callable[[], None], calls: int, groups: int):
    """µs per call of ``first`` and of ``second`` run alternately: medians over groups of the mean event-timed call,
    each group after an untimed ``first(); second()`` that brings the ranks in step (see the module docstring)."""
    first(), second()
    torch.cuda.synchronize()
    per_group = []
    for _ in range(groups):
        dist.barrier()
        first(), second()
        ev = _events(2 * calls + 1)
        ev[0].record()
        for i in range(calls):
            first()
            ev[2 * i + 1].record()
            second()
            ev[2 * i + 2].record()
        ev[-1].synchronize()
        a = sum(ev[2 * i].elapsed_time(ev[2 * i + 1]) for i in range(calls)) / calls
        b = sum(ev[2 * i + 1].elapsed_time(ev[2 * i + 2]) for i in range(calls)) / calls
        per_group.append((a * 1e3, b * 1e3))
    return statistics.median(g[0] for g in per_group), statistics.median(g[1] for g in per_group)


def _replay_us(graph: "torch.cuda.CUDAGraph", groups: int, steady: bool = True) -> float:
    """µs per replay of ``graph``: the median over ``groups`` of one event-timed replay. ``steady``: each timed replay
    follows an untimed one, enqueued with it right after the barrier, which absorbs the ranks' start skew (the
    graph's receives wait for every peer); otherwise the replay is timed straight after the barrier (cold)."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(groups):
        dist.barrier()
        start, end = _events(2)
        if steady:
            graph.replay()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _routing(rank: int, tokens: int, hidden: int, experts: int, topk: int, device):
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn((tokens, hidden), generator=g).to(torch.bfloat16).to(device)
    topk_idx = torch.rand((tokens, experts), generator=g).topk(topk, dim=1).indices.to(device)
    topk_weights = torch.rand((tokens, topk), generator=g).to(device)
    return x, topk_idx, topk_weights


def _launch_us(device) -> float:
    """Host cost of one tiny kernel launch, µs (back-to-back launches of an empty elementwise op)."""
    t = torch.zeros(1, device=device)
    return _median_us(lambda: t.add_(0), 200, 3)


def _phases_us(buffer: Buffer, x, topk_idx, topk_weights, tokens: int, experts: int, gap_us: float, groups: int):
    """Hooked send and receive phases of dispatch and combine, each the median of ``groups`` single calls."""
    gap_cycles = int(gap_us * 1.98e3)  # H200 SM clock ~1.98 GHz
    rows = {"dispatch_send": [], "dispatch_recv": [], "combine_send": [], "combine_recv": []}
    for _ in range(groups):
        dist.barrier()
        ev = _events(8)
        # The GPU spins while the host enqueues everything below, so the events time GPU work, not Python.
        torch.cuda._sleep(gap_cycles)
        ev[0].record()
        recv_x, _, handle, _, hook = buffer.low_latency_dispatch(
            x, topk_idx, tokens, experts, use_fp8=True, return_recv_hook=True
        )
        ev[1].record()
        torch.cuda._sleep(gap_cycles)
        ev[2].record()
        hook()
        ev[3].record()
        y = buffer.get_next_low_latency_combine_buffer(handle)
        ev[4].record()
        _, _, hook = buffer.low_latency_combine(
            y, topk_idx, topk_weights, handle, zero_copy=True, return_recv_hook=True
        )
        ev[5].record()
        torch.cuda._sleep(gap_cycles)
        ev[6].record()
        hook()
        ev[7].record()
        ev[7].synchronize()
        for name, (a, b) in zip(rows, ((0, 1), (2, 3), (4, 5), (6, 7))):
            rows[name].append(ev[a].elapsed_time(ev[b]) * 1e3)
    return {name: statistics.median(v) for name, v in rows.items()}


def host_share(graph_us: float, eager_us: float) -> float:
    """The share of an eager call's time that is launch and host work: 1 - graph / eager (0 when graph >= eager)."""
    return max(0.0, 1 - graph_us / eager_us) if eager_us > 0 else 0.0


def rank_setup(rank: int, world: int, args, max_tokens: int = 0, **buffer_kwargs):
    """This rank's device, the token counts of ``args.sweep`` and a CUDA low-latency Buffer sized for the largest (or
    for ``max_tokens`` per rank, if larger)."""
    use_nvshmem_on_one_machine()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    sweep = [int(t) for t in args.sweep.split(",")]
    # The hint grows with the tokens: the largest count sizes the buffer (max_tokens 0: the sweep's largest).
    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(max(*sweep, max_tokens), args.hidden, world, args.experts)
    buffer = Buffer(None, low_latency_mode=True, num_rdma_bytes=num_rdma_bytes, backend="cuda", **buffer_kwargs)
    return device, sweep, buffer


def _rank_main(rank: int, world: int, args) -> Dict:
    device, sweep, buffer = rank_setup(
        rank, world, args, timeout_s=args.kernel_timeout_s, validate_inputs=args.validate_inputs
    )
    hidden, experts, topk = args.hidden, args.experts, args.topk
    if "low_latency_dispatch" not in buffer.engine_calls:
        raise SystemExit("the CUDA engine has no low-latency kernels here (built without NVSHMEM?)")
    copy_gbps = copy_bandwidth_gbps(device) if rank == 0 else 0.0
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    ranks_on_gpu = -(-world // torch.cuda.device_count())
    launch_us = _launch_us(device)
    rows = {}
    for tokens in sweep:
        x, topk_idx, topk_weights = _routing(rank, tokens, hidden, experts, topk, device)
        entries = int((topk_idx >= 0).sum())
        dispatch_bytes = entries * (hidden + hidden // 128 * 4)
        combine_bytes = entries * hidden * 2
        state = {}

        def dispatch():
            state["out"] = buffer.low_latency_dispatch(x, topk_idx, tokens, experts, use_fp8=True)

        def combine():
            handle = state["out"][2]
            y = buffer.get_next_low_latency_combine_buffer(handle)
            buffer.low_latency_combine(y, topk_idx, topk_weights, handle, zero_copy=True)

        def pair():
            dispatch()
            combine()

        dispatch_us, combine_us = _alternating_us(dispatch, combine, args.calls, args.groups)
        pair_us = dispatch_us + combine_us

        # The same pair from a CUDA graph: per-pair time without launch and Python cost.
        pair()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(args.calls):
                pair()
        graph_pair_us = _replay_us(graph, args.groups) / args.calls
        graph_pair_cold_us = _replay_us(graph, args.groups, steady=False) / args.calls
        # Dispatches alone and combines alone (of the handle of the last eager dispatch): an even number of calls per
        # graph, so a replay leaves the buffer halves in the order the host expects.
        graph_calls = args.calls + args.calls % 2
        graph_d, graph_c = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        dispatch()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph_d):
            for _ in range(graph_calls):
                dispatch()
        dispatch()  # the handle every captured combine uses (eager: its receive has run)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph_c):
            for _ in range(graph_calls):
                combine()
        graph_dispatch_us = _replay_us(graph_d, args.groups) / graph_calls
        graph_combine_us = _replay_us(graph_c, args.groups) / graph_calls
        # One dispatch and one combine (of that dispatch's handle) captured in two graphs and replayed alternately,
        # timed as the eager calls are: each call's GPU time in the decode loop's order, so that against the eager
        # call the difference is its launch and host cost alone. (Back to back, the "alone" graphs never wait for a
        # peer's previous call of the other kind; the eager combine after a dispatch does, at 8 ranks by tens of µs.)
        # A pair of calls before the captures keeps the halves in the order the eager loop used.
        graph_d1, graph_c1 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        pair()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph_d1):
            dispatch()
        with torch.cuda.graph(graph_c1):
            combine()
        graph_alt_dispatch_us, graph_alt_combine_us = _alternating_us(
            graph_d1.replay, graph_c1.replay, args.calls, args.groups
        )
        phases = _phases_us(buffer, x, topk_idx, topk_weights, tokens, experts, args.gap_us, args.groups)
        del graph, graph_d, graph_c, graph_d1, graph_c1
        grid_blocks = buffer._backend.ll.grid_blocks(tokens, tokens, experts, hidden)
        rows[tokens] = dict(
            sm_share=grid_blocks / sm_count,
            all_sm_share=min(1.0, grid_blocks * ranks_on_gpu / sm_count),
            entries=entries,
            dispatch_bytes=dispatch_bytes,
            combine_bytes=combine_bytes,
            dispatch_us=dispatch_us,
            combine_us=combine_us,
            graph_pair_us=graph_pair_us,
            graph_pair_cold_us=graph_pair_cold_us,
            graph_dispatch_us=graph_dispatch_us,
            graph_combine_us=graph_combine_us,
            graph_alt_dispatch_us=graph_alt_dispatch_us,
            graph_alt_combine_us=graph_alt_combine_us,
            eager_pair_us=pair_us,
            **phases,
        )
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    buffer.destroy()
    return {"rows": gathered, "copy_gbps": copy_gbps, "launch_us": launch_us}


def shape_parser(description: str, sweep: str) -> argparse.ArgumentParser:
    """The arguments every low-latency benchmark takes: ranks, tokens per rank (``sweep``: the default) and shape."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--sweep", default=sweep, help="comma-separated tokens per rank")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    return parser


def main(argv=None) -> int:
    parser = shape_parser(__doc__, "128")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--groups", type=int, default=10)
    parser.add_argument("--gap-us", type=float, default=1000.0, help="GPU spin before a timed receive phase")
    parser.add_argument("--validate-inputs", action="store_true", help="check topk_idx on every call (a host sync)")
    parser.add_argument("--kernel-timeout-s", type=float, default=30.0, help="a lost signal fails the run this fast")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    results = spawn(_rank_main, args.ranks, args, backend="gloo")
    r0 = results[0]
    per_rank = r0["rows"]
    copy_gbps = r0["copy_gbps"]
    # The ranks inherit the switch (docs/architecture.md, "Pending kernels"); a figure says which kernels gave it.
    pending_kernels = settings.pending_kernels()
    print(
        f"ranks {args.ranks} on {torch.cuda.device_count()} GPU(s) ({torch.cuda.get_device_name(0)}), hidden "
        f"{args.hidden}, top-{args.topk} of {args.experts}; copy bandwidth {copy_gbps:.0f} GB/s; one kernel launch "
        f"{r0['launch_us']:.1f} µs. Times: slowest rank, µs per call."
        + (" Pending kernels on (EP_DISPATCHER_PENDING_KERNELS=1)." if pending_kernels else "")
    )
    header = (
        f"{'tokens':>6} {'dispatch':>9} {'combine':>8} {'graph d+c':>9} {'graph cold':>10} {'d send':>7} {'d recv':>7} "
        f"{'c send':>7} {'c recv':>7} {'disp GB/s':>9} {'comb GB/s':>9} {'agg disp GB/s':>13} {'copy-limit d+c':>14} "
        f"{'copy/graph':>10} {'host %':>6} {'d host %':>8} {'c host %':>8} {'SM %':>5} {'all SM %':>8}"
    )
    print(header)
    summary = {}
    for tokens in per_rank[0]:
        rows = [r[tokens] for r in per_rank]
        worst = {k: max(r[k] for r in rows) for k in rows[0]}
        d_bytes = sum(r["dispatch_bytes"] for r in rows)
        c_bytes = sum(r["combine_bytes"] for r in rows)
        rank_d_gbps = statistics.mean(r["dispatch_bytes"] for r in rows) / (worst["dispatch_us"] * 1e3)
        rank_c_gbps = statistics.mean(r["combine_bytes"] for r in rows) / (worst["combine_us"] * 1e3)
        copy_limit_us = 2 * (d_bytes + c_bytes) / (copy_gbps * 1e3)  # aggregate bytes, read + write, at copy speed
        print(
            f"{tokens:>6} {worst['dispatch_us']:>9.1f} {worst['combine_us']:>8.1f} {worst['graph_pair_us']:>9.1f} "
            f"{worst['graph_pair_cold_us']:>10.1f} {worst['dispatch_send']:>7.1f} {worst['dispatch_recv']:>7.1f} "
            f"{worst['combine_send']:>7.1f} {worst['combine_recv']:>7.1f} {rank_d_gbps:>9.1f} {rank_c_gbps:>9.1f} "
            f"{d_bytes / (worst['dispatch_us'] * 1e3):>13.1f} {copy_limit_us:>14.1f} "
            f"{100 * copy_limit_us / worst['graph_pair_us']:>9.0f}% "
            f"{100 * host_share(worst['graph_pair_us'], worst['eager_pair_us']):>6.0f} "
            f"{100 * host_share(worst['graph_alt_dispatch_us'], worst['dispatch_us']):>8.0f} "
            f"{100 * host_share(worst['graph_alt_combine_us'], worst['combine_us']):>8.0f} "
            f"{100 * worst['sm_share']:>5.0f} {100 * worst['all_sm_share']:>8.0f}"
        )
        summary[tokens] = dict(
            worst,
            rank_dispatch_gbps=rank_d_gbps,
            rank_combine_gbps=rank_c_gbps,
            aggregate_dispatch_bytes=d_bytes,
            aggregate_combine_bytes=c_bytes,
            copy_limit_pair_us=copy_limit_us,
            floor_ratio=copy_limit_us / worst["graph_pair_us"],
            launch_overhead_share=host_share(worst["graph_pair_us"], worst["eager_pair_us"]),
            dispatch_host_share=host_share(worst["graph_alt_dispatch_us"], worst["dispatch_us"]),
            combine_host_share=host_share(worst["graph_alt_combine_us"], worst["combine_us"]),
            # Against the back-to-back graphs (what this benchmark printed before 2026-12-07, eighth session).
            dispatch_host_share_vs_alone=host_share(worst["graph_dispatch_us"], worst["dispatch_us"]),
            combine_host_share_vs_alone=host_share(worst["graph_combine_us"], worst["combine_us"]),
        )
    print(f"published (dispatch, combine) µs at 128 tokens, real NVLink/RDMA: {PUBLISHED_US}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "pending_kernels": pending_kernels,
                    "copy_gbps": copy_gbps,
                    "launch_us": r0["launch_us"],
                    "per_tokens": summary,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
