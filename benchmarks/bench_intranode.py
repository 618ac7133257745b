"""Intranode dispatch/combine benchmark: N ranks on the visible GPU(s) (one GPU: run under MPS).

    python benchmarks/bench_intranode.py --ranks 8 --num-sms 16               # the standard shape
    python benchmarks/bench_intranode.py --ranks 8 --sweep 512,1024,2048,4096,8192 --out bench.json
    python benchmarks/bench_intranode.py --ranks 1 --num-sms 132                # EP = 1: loopback on the whole GPU

Standard shape (DESIGN.md section 6): 4096 tokens/rank, hidden 7168, top-8 of 256 experts, FP8 dispatch,
BF16 combine. Bandwidth in the field's accounting: bytes received by a rank (``recv_x`` incl. the local share;
FP8 counts data + scales) over the call's time; "wire" excludes the local share. The limit on one GPU is the
device-to-device copy bandwidth measured in the same run (bytes read + written); each call's own traffic on one
GPU is several HBM passes per logical byte, so the ratio says how close the design is to what one GPU can do.
"HBM traffic" counts what a call must move at least (each input row read once, each output row written once) against
the same copy bandwidth: at EP = 1 (loopback) that is the share of the GPU's memory bandwidth the call reaches.
Times are medians over several groups of back-to-back calls (ranks stay in lock step through the kernels'
barriers), measured with CUDA events; by default each group starts behind one untimed call (``--timing steady``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ep_dispatcher import Buffer, Config, per_token_cast_to_fp8  # noqa: E402
from ep_dispatcher.launch import spawn  # noqa: E402

STAGING_REFERENCE_GBPS = {
    "dispatch": 935.0,
    "combine": 1090.0,
}  # DESIGN.md 6: best-known staging design, 8 ranks, 16 SMs


def _time_calls(fn: Callable[[], object], calls: int, groups: int, lead: bool = False) -> float:
    """Median over ``groups`` of the mean time (s) of ``calls`` back-to-back calls.

    ``lead``: one untimed call is issued before the start event of each group, so the timed calls find the GPU busy
    (steady state: the host prepares each call while the GPU runs the one before). Without it the GPU idles through the
    first call's host preamble (argument checks, launches), which adds preamble / ``calls`` to every call's time.
    """
    fn()
    torch.cuda.synchronize()
    per_call: List[float] = []
    for _ in range(groups):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead:
            fn()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(per_call)


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + bytes written, GB/s."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times) / 1e9


def _routing(rank: int, tokens: int, hidden: int, experts: int, topk: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn((tokens, hidden), generator=g).to(torch.bfloat16).to(device)
    scores = torch.rand((tokens, experts), generator=g)
    topk_idx = scores.topk(topk, dim=1).indices.to(device)
    topk_weights = torch.rand((tokens, topk), generator=g).to(device)
    return x, topk_idx, topk_weights


def nvl_bytes(max_tokens: int, world: int, hidden: int, topk: int) -> int:
    """Room for the worst case: every rank's tokens arrive here (dispatch), each token goes to min(R, k) ranks
    (combine)."""
    dispatch_rows = max_tokens * world * (hidden + hidden // 128 * 4 + topk * 12 + 4)
    combine_rows = max_tokens * min(world, topk) * (hidden * 2 + topk * 4)
    return max(dispatch_rows, combine_rows) + (16 << 20)


def dispatch_inputs(buffer: Buffer, rank: int, tokens: int, args, device, config: Config):
    """This rank's routed tokens and the keyword arguments of a fresh dispatch: ``(x, x_fp8, topk_idx, kwargs)``."""
    x, topk_idx, topk_weights = _routing(rank, tokens, args.hidden, args.experts, args.topk, device)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
    kwargs = dict(
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        config=config,
    )
    return x, per_token_cast_to_fp8(x), topk_idx, kwargs


def intranode_calls(
    buffer: Buffer, args, topk_idx, x, x_fp8, kwargs: dict, handle, y, worst: int
) -> Dict[str, Callable]:
    """The calls the benchmark times: layout, FP8 / worst-case FP8 / BF16 / cached FP8 dispatch and BF16 combine."""
    config = kwargs["config"]
    return {
        "layout": lambda: buffer.get_dispatch_layout(topk_idx, args.experts),
        "dispatch_fp8": lambda: buffer.dispatch(x_fp8, **kwargs),
        "dispatch_fp8_worst": lambda: buffer.dispatch(x_fp8, num_worst_tokens=worst, **kwargs),
        "dispatch_bf16": lambda: buffer.dispatch(x, **kwargs),
        "cached_dispatch_fp8": lambda: buffer.dispatch(x_fp8, handle=handle, config=config),
        "combine_bf16": lambda: buffer.combine(y, handle, config=config),
    }


def time_calls(buffer: Buffer, args, topk_idx, x, x_fp8, kwargs: dict, handle, y, worst: int) -> Dict[str, float]:
    """Seconds per call of each of intranode_calls."""
    calls = intranode_calls(buffer, args, topk_idx, x, x_fp8, kwargs, handle, y, worst)
    lead = getattr(args, "timing", "cold") == "steady"
    return {kind: _time_calls(call, args.calls, args.groups, lead) for kind, call in calls.items()}


def _rank_main(rank: int, world: int, args) -> Dict:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    copy_gbps = copy_bandwidth_gbps(device) if rank == 0 else 0.0
    dist.barrier()
    num_nvl_bytes = nvl_bytes(max(args.sweep), world, args.hidden, args.topk)
    buffer = Buffer(None, num_nvl_bytes=num_nvl_bytes, backend="cuda", validate_inputs=False)
    config = Config(args.num_sms)
    results = []
    for tokens in args.sweep:
        x, x_fp8, topk_idx, kwargs = dispatch_inputs(buffer, rank, tokens, args, device, config)
        in_rank = kwargs["is_token_in_rank"]
        recv, _, _, _, handle, _ = buffer.dispatch(x_fp8, **kwargs)
        num_recv = recv[0].size(0)
        local_rows = int(in_rank[:, rank].sum())
        worst = tokens * world
        y = torch.randn((num_recv, args.hidden), device=device).to(torch.bfloat16)
        times = time_calls(buffer, args, topk_idx, x, x_fp8, kwargs, handle, y, worst)
        fp8_row, bf16_row = args.hidden + args.hidden // 128 * 4, args.hidden * 2
        results.append(
            {
                "tokens": tokens,
                "num_recv": num_recv,
                "local_rows": local_rows,
                "times": times,
                "bytes": {
                    "dispatch_fp8": num_recv * fp8_row,
                    "dispatch_fp8_worst": num_recv * fp8_row,
                    "cached_dispatch_fp8": num_recv * fp8_row,
                    "dispatch_bf16": num_recv * bf16_row,
                    "combine_bf16": num_recv * bf16_row,
                    "layout": 0,
                },
                "wire_bytes": {
                    "dispatch_fp8": (num_recv - local_rows) * fp8_row,
                    "combine_bf16": (num_recv - local_rows) * bf16_row,
                },
                # HBM bytes the call must move at least (each input row read once, each output row written once):
                # the fair comparison with the copy bandwidth, which counts read + write.
                "hbm_bytes": {
                    "dispatch_fp8": (tokens + num_recv) * fp8_row,
                    "dispatch_fp8_worst": (tokens + num_recv) * fp8_row,
                    "cached_dispatch_fp8": (tokens + num_recv) * fp8_row,
                    "dispatch_bf16": (tokens + num_recv) * bf16_row,
                    "combine_bf16": (num_recv + tokens) * bf16_row,
                },
            }
        )
    tune = _tune_num_sms(buffer, rank, args, device) if args.tune_sms else {}
    buffer.destroy()
    return {"rank": rank, "copy_gbps": copy_gbps, "results": results, "tune": tune}


def _tune_num_sms(buffer: Buffer, rank: int, args, device) -> Dict[str, Dict[int, float]]:
    """Time FP8 dispatch and BF16 combine at the first sweep size for each SM count of ``--tune-sms``."""
    tokens = args.sweep[0]
    x, topk_idx, topk_weights = _routing(rank, tokens, args.hidden, args.experts, args.topk, device)
    x_fp8 = per_token_cast_to_fp8(x)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    times: Dict[str, Dict[int, float]] = {"dispatch": {}, "combine": {}}
    for num_sms in args.tune_sms:
        config = Config(num_sms)
        kwargs = dict(layout, topk_idx=topk_idx, topk_weights=topk_weights, config=config)
        recv, _, _, _, handle, _ = buffer.dispatch(x_fp8, **kwargs)
        y = torch.randn((recv[0].size(0), args.hidden), device=device).to(torch.bfloat16)
        times["dispatch"][num_sms] = _time_calls(lambda: buffer.dispatch(x_fp8, **kwargs), args.calls, args.groups)
        combine = lambda: buffer.combine(y, handle, config=config)  # noqa: E731
        times["combine"][num_sms] = _time_calls(combine, args.calls, args.groups)
    return times


def write_tuned_sms(per_rank: List[Dict], args) -> str:
    """Pick, per call, the fewest SMs within 5% of the fastest (slowest rank's median), and write them with the
    measured times to configs/<gpu>.json (chunk sizes copied from the table in use: the engine does not read them)."""
    from ep_dispatcher import config as config_module

    gpu = config_module.gpu_config_name() or "unknown_gpu"
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", f"{gpu}.json")
    table = json.loads(json.dumps(config_module._load_config_table(gpu)))  # a copy of what is in use now
    table["_comment"] = (
        "num_sms: the fewest SMs within 5% of the fastest measured by benchmarks/bench_intranode.py --tune-sms "
        "(slowest rank, median); pass it to Buffer.set_num_sms or Config(num_sms). Chunk sizes are DeepEP-compatible "
        "fields the write-once intranode engine does not read."
    )
    for kind in ("dispatch", "combine"):
        worst = {n: max(r["tune"][kind][n] for r in per_rank) for n in args.tune_sms}
        best = min(worst.values())
        chosen = min(n for n, t in worst.items() if t <= best * 1.05)
        table.setdefault("num_sms", {}).setdefault(kind, {})[str(args.ranks)] = chosen
        table.setdefault("measured_us", {}).setdefault(kind, {})[str(args.ranks)] = {
            str(n): round(t * 1e6, 1) for n, t in worst.items()
        }
        print(f"  tune {kind}: " + ", ".join(f"{n} SMs {t * 1e6:.0f} us" for n, t in worst.items()) + f" -> {chosen}")
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--num-sms", type=int, default=16)
    parser.add_argument("--sweep", type=lambda s: [int(v) for v in s.split(",")], default=[4096])
    parser.add_argument("--calls", type=int, default=10, help="back-to-back calls per timed group")
    parser.add_argument("--groups", type=int, default=5)
    parser.add_argument(
        "--timing",
        choices=("steady", "cold"),
        default="steady",
        help="steady: an untimed call runs before each timed group, so the GPU is busy when timing starts; cold: "
        "timing starts on an idle GPU (the first call's host preamble counts)",
    )
    parser.add_argument("--out", default=None, help="write the full results as JSON here")
    parser.add_argument(
        "--tune-sms",
        type=lambda s: [int(v) for v in s.split(",")],
        default=None,
        help="comma-separated SM counts: time each at the first sweep size and write configs/<gpu>.json",
    )
    args = parser.parse_args(argv)
    per_rank = spawn(_rank_main, args.ranks, args)
    copy_gbps = per_rank[0]["copy_gbps"]
    gpus = torch.cuda.device_count()
    print(
        f"intranode: {args.ranks} ranks on {min(gpus, args.ranks)} GPU(s) ({torch.cuda.get_device_name()}), "
        f"{args.num_sms} SMs/rank, hidden {args.hidden}, top-{args.topk} of {args.experts}, {args.timing} timing; "
        f"copy bandwidth {copy_gbps:.0f} GB/s (read+write)"
    )
    table = []
    for i, tokens in enumerate(args.sweep):
        rows = [r["results"][i] for r in per_rank]
        for kind in (
            "layout",
            "dispatch_fp8",
            "dispatch_fp8_worst",
            "cached_dispatch_fp8",
            "dispatch_bf16",
            "combine_bf16",
        ):
            t = statistics.median(r["times"][kind] for r in rows)
            agg_bytes = sum(r["bytes"][kind] for r in rows)
            agg = agg_bytes / t / 1e9 if agg_bytes else 0.0
            hbm = sum(r["hbm_bytes"].get(kind, 0) for r in rows) / t / 1e9
            ref = STAGING_REFERENCE_GBPS.get(kind.split("_")[0] if kind != "combine_bf16" else "combine")
            entry = {
                "tokens": tokens,
                "kind": kind,
                "us": t * 1e6,
                "agg_GBps": agg,
                "per_rank_GBps": agg / args.ranks,
                "bytes_per_rank": agg_bytes / args.ranks,
                "ratio_to_copy_bw": agg / copy_gbps if copy_gbps else None,
                "hbm_GBps": hbm,
                "hbm_share_of_copy_bw": hbm / copy_gbps if copy_gbps else None,
                "vs_staging_reference": (agg / ref)
                if (ref and kind in ("dispatch_fp8", "dispatch_fp8_worst", "combine_bf16"))
                else None,
            }
            table.append(entry)
            extra = f" {entry['vs_staging_reference']:.2f}x staging ref" if entry["vs_staging_reference"] else ""
            print(
                f"  tokens {tokens:5d} {kind:20s} {t * 1e6:9.1f} us  {agg_bytes / args.ranks / 1e6:8.2f} MB/rank  "
                f"agg {agg:8.1f} GB/s  ({agg / copy_gbps:5.1%} of copy bw; HBM traffic {hbm / copy_gbps:5.1%}){extra}"
            )
    if args.tune_sms:
        print(f"  tuned SM counts written to {write_tuned_sms(per_rank, args)}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "copy_gbps": copy_gbps, "table": table, "per_rank": per_rank}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
