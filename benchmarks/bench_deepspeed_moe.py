"""DeepSpeed-MoE layer forward + backward: DeepSpeed's dispatch vs ep_dispatcher's, expert parallelism 1.

    python benchmarks/bench_deepspeed_moe.py --out bench_deepspeed_moe.json        # one GPU, the standard shape
    python benchmarks/bench_deepspeed_moe.py --cpu --small --out /tmp/bench.json   # smoke test on CPU

Standard shape: 8192 tokens, hidden 4096, 64 experts, top-2 (DeepSpeed's gate with 2nd-expert sampling), no token
drops (``drop_tokens=False``), expert MLP hidden -> ffn -> hidden with GELU, bf16 on the GPU. Rows of the table:
* ``deepspeed``: ``deepspeed.moe.layer.MoE`` as it is (dense ``[experts, capacity, hidden]`` buffers);
* ``ep_dispatcher``: the same layer after ``ep_dispatcher.deepspeed.patch`` (dispatch/combine through a ``Buffer``
  on a one-rank expert-parallel group);
* ``ep_dispatcher_local``: the patched layer with no group (every expert local, no ``Buffer`` call at all).
Each step is the gate, dispatch, experts, combine and the backward of ``(out * g).sum() + l_aux``; times are the
median (and min) over timed steps after warm-up (CUDA events on the GPU, wall clock on CPU). The output of each row
is compared with DeepSpeed's for the same gate random numbers.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ep_dispatcher.launch import free_port  # noqa: E402


def _timed_steps(step: Callable[[], None], warmup: int, iters: int, on_gpu: bool) -> List[float]:
    for _ in range(warmup):
        step()
    times: List[float] = []
    for _ in range(iters):
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=2048, help="expert MLP inner size")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--cpu", action="store_true", help="run on CPU (fp32, gloo)")
    p.add_argument("--small", action="store_true", help="256 tokens, hidden 64, ffn 128, 8 experts, 3 iters")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.small:
        args.tokens, args.hidden, args.ffn, args.experts, args.iters, args.warmup = 256, 64, 128, 8, 3, 1
    on_gpu = not args.cpu
    if on_gpu and not torch.cuda.is_available():
        raise SystemExit("no GPU visible: pass --cpu (and --small for a quick run)")
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    backend = "nccl" if on_gpu else "gloo"

    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    if on_gpu:
        torch.cuda.set_device(device)
    # The reference backend gathers counts on the host: a GPU group needs gloo for CPU tensors beside NCCL.
    pg_backend = "cpu:gloo,cuda:nccl" if on_gpu else "gloo"
    dist.init_process_group(pg_backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    import deepspeed
    from deepspeed.moe.layer import MoE

    from ep_dispatcher import deepspeed as ep_ds

    if not on_gpu:  # skip DeepSpeed's ~30 s JIT build of a CPU shared-memory all-reduce nobody uses here
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend=backend)

    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(args.hidden, args.ffn), nn.GELU(), nn.Linear(args.ffn, args.hidden))
    theirs = MoE(
        args.hidden, expert, num_experts=args.experts, ep_size=1, k=args.topk, min_capacity=0, drop_tokens=False
    )
    ours = copy.deepcopy(theirs)  # same weights; deep-copied before the groups exist (a group cannot be copied)
    ours_local = copy.deepcopy(theirs)
    ep_ds.patch(ours)
    ep_ds.patch(ours_local)
    theirs.set_deepspeed_parallelism()
    ours.set_deepspeed_parallelism()
    layers = {"deepspeed": theirs, "ep_dispatcher": ours, "ep_dispatcher_local": ours_local}
    for layer in layers.values():
        layer.to(device=device, dtype=dtype)
    ours_local.deepspeed_moe.ep_group = None  # the no-Buffer path (the gate keeps its one-rank group)

    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn((args.tokens, args.hidden), generator=g, device=device, dtype=dtype)
    grad = torch.randn((args.tokens, args.hidden), generator=g, device=device, dtype=dtype)

    def make_step(layer):
        def step():
            layer.zero_grad(set_to_none=True)
            xin = x.detach().requires_grad_()
            torch.manual_seed(2)
            out, l_aux, _ = layer(xin)
            ((out * grad).sum() + l_aux).backward()
            return out

        return step

    with torch.no_grad():
        outputs = {}
        for name, layer in layers.items():
            torch.manual_seed(2)
            outputs[name] = layer(x)[0].float()
    results = {}
    for name, layer in layers.items():
        times = _timed_steps(make_step(layer), args.warmup, args.iters, on_gpu)
        results[name] = {
            "median_ms": statistics.median(times) * 1e3,
            "min_ms": min(times) * 1e3,
            "max_abs_diff_vs_deepspeed": float((outputs[name] - outputs["deepspeed"]).abs().max()),
        }
        if on_gpu:
            torch.cuda.empty_cache()

    base = results["deepspeed"]["median_ms"]
    dev_name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    print(
        f"DeepSpeed-MoE layer fwd+bwd, EP=1, {dev_name}, {dtype}: {args.tokens} tokens, hidden {args.hidden}, "
        f"ffn {args.ffn}, {args.experts} experts, top-{args.topk}, no drops"
    )
    print(f"{'variant':<22} {'median ms':>10} {'min ms':>10} {'speed-up':>9} {'max |out diff|':>15}")
    for name, r in results.items():
        print(
            f"{name:<22} {r['median_ms']:>10.3f} {r['min_ms']:>10.3f} {base / r['median_ms']:>8.2f}x "
            f"{r['max_abs_diff_vs_deepspeed']:>15.2e}"
        )
    report = {
        "date": datetime.date.today().isoformat(),
        "device": dev_name,
        "dtype": str(dtype),
        "deepspeed_version": deepspeed.__version__,
        "torch_version": torch.__version__,
        "command": " ".join(sys.argv),
        "config": vars(args),
        "results": results,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.out}")
    ep_ds.clear_buffers()
    dist.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
