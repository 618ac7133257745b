"""Host and GPU time per ``get_dispatch_layout`` call on every rank: ours, or DeepEP's through the same Buffer API.

    python benchmarks/profile_layout.py --ranks 4                                    # one GPU: run under MPS
    PYTHONPATH=.deepep/DeepEP python benchmarks/profile_layout.py --ranks 4 --impl deepep
    EP_DISPATCHER_PENDING_KERNELS=1 python benchmarks/profile_layout.py --ranks 4     # the pending owner kernel

Each rank makes --calls back-to-back calls on its current stream. "host µs" is the wall time per call on the host
(nothing waits); "GPU µs" is the CUDA-event time per call over the same calls. Equal figures mean a host-bound call
(the GPU waits for the launches); a larger GPU figure means the kernels bound it. For ours the script also times the
C++ entry alone (``_C.get_dispatch_layout``) and two baselines: an empty CUDA allocation of the outputs' size, and the
same zero-filled (one memset launch more). Routing as DeepEP's tests: the top-k of |randn| + 1 per token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ep_dispatcher import settings  # noqa: E402
from ep_dispatcher.launch import spawn  # noqa: E402

WARMUP_CALLS = 5


def host_and_gpu_us(fn, calls: int) -> tuple[float, float]:
    """(host µs, CUDA-event µs) per call of ``fn`` over ``calls`` back-to-back calls, the ranks starting together."""
    for _ in range(WARMUP_CALLS):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host_start = time.perf_counter()
    for _ in range(calls):
        fn()
    host_s = time.perf_counter() - host_start
    end.record()
    end.synchronize()
    return host_s / calls * 1e6, start.elapsed_time(end) / calls * 1e3


def _rank_main(rank: int, world: int, args) -> dict:
    torch.cuda.set_device(0 if torch.cuda.device_count() == 1 else rank)
    if args.impl == "ours":
        import ep_dispatcher as library
    else:
        import deep_ep as library
    torch.manual_seed(rank)
    scores = torch.randn(args.tokens, args.experts, device="cuda").abs() + 1
    topk_idx = torch.topk(scores, args.topk, dim=-1, sorted=False).indices
    buffer = library.Buffer(dist.group.WORLD, int(1e9), 0)
    timings = {"layout": host_and_gpu_us(lambda: buffer.get_dispatch_layout(topk_idx, args.experts), args.calls)}
    if args.impl == "ours":
        from ep_dispatcher import _C

        def entry():
            return _C.get_dispatch_layout(topk_idx, args.experts, world, world)

        output_bytes = args.tokens * world + 4 * (world + args.experts)
        timings["C++ entry"] = host_and_gpu_us(entry, args.calls)
        timings["empty"] = host_and_gpu_us(
            lambda: torch.empty(output_bytes, dtype=torch.uint8, device="cuda"), args.calls
        )
        timings["empty + zero"] = host_and_gpu_us(
            lambda: torch.zeros(output_bytes, dtype=torch.uint8, device="cuda"), args.calls
        )
    dist.barrier()
    return timings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--impl", choices=("ours", "deepep"), default="ours")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", default=None, help="write the per-rank figures as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    if args.experts % args.ranks != 0:
        parser.error(f"--experts ({args.experts}) must be a multiple of --ranks ({args.ranks})")
    per_rank = spawn(_rank_main, args.ranks, args, backend="gloo")
    # The ranks inherit the switch; the C++ reads it (docs/architecture.md, "Pending kernels").
    pending_kernels = settings.pending_kernels()
    print(
        f"profile_layout: {args.impl}{' (pending kernels)' if pending_kernels else ''}, {args.ranks} ranks on "
        f"{torch.cuda.get_device_name()}, {args.tokens} tokens top-{args.topk} of {args.experts}, {args.calls} "
        "back-to-back calls; µs per call, median over ranks"
    )
    print(f"  {'what':12s} {'host µs':>9s} {'GPU µs':>9s}   host µs per rank")
    summary = {}
    for what in per_rank[0]:
        host = [r[what][0] for r in per_rank]
        gpu = [r[what][1] for r in per_rank]
        summary[what] = {"host_us": host, "gpu_us": gpu}
        per_rank_host = " ".join(f"{h:.1f}" for h in host)
        print(f"  {what:12s} {statistics.median(host):9.1f} {statistics.median(gpu):9.1f}   {per_rank_host}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "pending_kernels": pending_kernels, "per_rank": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
