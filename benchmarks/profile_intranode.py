"""Per-kernel GPU time of one rank's intranode calls (EP = 1, loopback): the calls bench_intranode.py times (layout,
fresh, ``num_worst_tokens``, BF16 and cached dispatch, BF16 combine), by torch.profiler (CUPTI).

    python benchmarks/profile_intranode.py --tokens 65536

Shape as bench_intranode.py (hidden 7168, top-8 of 256, FP8 dispatch, BF16 combine, one rank, all SMs). For each
call: the median time of --calls calls timed one by one with CUDA events, then each kernel's GPU time per call
(summed over --profiled calls). Fresh minus cached is the count exchange's cost on the GPU: the send-position scan
with its ``topk_idx`` check, notify, and what the fresh data kernel writes besides the rows.

One rank launches its kernels chained (``csrc/kernels/launch.cuh``): a kernel then starts while the one before it
still runs and waits for it, and the profiler counts that wait as the kernel's time (the printed idle time goes
negative). Run with ``EP_DISPATCHER_CHAINED_LAUNCH=0`` for each kernel's own time.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ep_dispatcher import Buffer, Config  # noqa: E402
from ep_dispatcher.launch import spawn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_intranode import dispatch_inputs, intranode_calls, nvl_bytes  # noqa: E402
from profile_low_latency import short_kernel_name  # noqa: E402


def _event_us(fn, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(calls):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _kernel_us(fn, profiled: int) -> tuple:
    """Each kernel's GPU time per call, and the GPU span per call: first kernel start to last kernel end over the
    profiled calls, divided by their number (span minus the kernels' sum is the idle time between kernels)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            fn()
        torch.cuda.synchronize()
    per_kernel = collections.defaultdict(float)
    starts, ends = [], []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[short_kernel_name(event.name)] += event.device_time / profiled
            starts.append(event.time_range.start)
            ends.append(event.time_range.end)
    span = (max(ends) - min(starts)) / profiled if starts else 0.0
    return dict(sorted(per_kernel.items(), key=lambda item: -item[1])), span


def _profile_one_rank(rank: int, world: int, args) -> None:
    """Runs in a process of its own: a Buffer needs a process group, here of one rank (gloo)."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    num_sms = args.num_sms or torch.cuda.get_device_properties(device).multi_processor_count
    num_nvl_bytes = nvl_bytes(args.tokens, world, args.hidden, args.topk)
    buffer = Buffer(None, num_nvl_bytes=num_nvl_bytes, backend="cuda", validate_inputs=False)
    config = Config(num_sms)
    x, x_fp8, topk_idx, kwargs = dispatch_inputs(buffer, rank, args.tokens, args, device, config)
    recv, _, _, _, handle, _ = buffer.dispatch(x_fp8, **kwargs)
    y = torch.randn((recv[0].size(0), args.hidden), device=device).to(torch.bfloat16)
    calls = intranode_calls(buffer, args, topk_idx, x, x_fp8, kwargs, handle, y, args.tokens)
    print(f"one rank, {args.tokens} tokens, hidden {args.hidden}, top-{args.topk} of {args.experts}, {num_sms} SMs")
    for name, fn in calls.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        print(f"{name}: {_event_us(fn, args.calls):.1f} us per call (CUDA events, median)")
        per_kernel, span = _kernel_us(fn, args.profiled)
        busy = sum(per_kernel.values())
        print(f"  GPU span {span:.1f} us per call: kernels {busy:.1f} us, idle between them {span - busy:.1f} us")
        for kernel, us in per_kernel.items():
            print(f"  {us:9.1f} us  {kernel}")
    buffer.destroy()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--num-sms", type=int, default=None, help="default: every SM of the GPU")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--profiled", type=int, default=5)
    spawn(_profile_one_rank, 1, parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
