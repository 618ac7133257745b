"""Internode dispatch/combine benchmark with virtual nodes: N ranks on the visible GPU(s) (one GPU: run under MPS).

    python benchmarks/bench_internode.py --ranks 8 --ranks-per-node 4 --num-sms 16          # the standard shape
    python benchmarks/bench_internode.py --ranks 8 --ranks-per-node 2 --sweep 1024,4096 --out bench.json

Standard shape (DESIGN.md section 6): 4096 tokens/rank, hidden 7168, top-8 of 256 experts, FP8 dispatch, BF16
combine. Ranks form nodes of ``--ranks-per-node`` consecutive ranks; a token crosses the RDMA leg (NVSHMEM puts)
once per remote destination node and is forwarded over the NVLink leg (direct stores) inside the node.

Bytes per rank, reported for each leg separately (payload rows only: FP8 data + scales, or BF16 rows):
  * RDMA leg, logical: tokens x destination nodes, including the source's own node; wire: remote nodes only.
  * NVLink leg, logical: rows received by the rank (dispatch) / rows sent back (combine), incl. the local share;
    wire: excluding rows that the forwarder writes into its own buffer (same rank).
GB/s = aggregate bytes over all ranks / median call time. Per-kernel times (``--profile``) come from torch.profiler
on rank 0 over a few dispatch + combine calls.
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

from ep_dispatcher import Buffer, Config, per_token_cast_to_fp8  # noqa: E402
from ep_dispatcher.launch import spawn, use_nvshmem_on_one_machine  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_intranode import _routing, time_calls  # noqa: E402  (same timing and routing as the intranode bench)


def _leg_rows(rank: int, world: int, per_node: int, in_rank: torch.Tensor, count_matrix: torch.Tensor) -> Dict:
    """Row counts of both legs for this rank (see the module docstring)."""
    num_nodes = world // per_node
    in_node = in_rank.view(in_rank.size(0), num_nodes, per_node).any(2)
    node = rank // per_node
    recv_from = count_matrix[:, rank]  # rows this rank receives from each source
    # A row reaches this rank through the forwarder with the source's local index: same rank iff same local index.
    own_forwarder = sum(int(recv_from[s]) for s in range(world) if s % per_node == rank % per_node)
    return {
        "rdma_logical": int(in_node.sum()),
        "rdma_wire": int(in_node.sum()) - int(in_node[:, node].sum()),
        "nvl_logical": int(recv_from.sum()),
        "nvl_wire": int(recv_from.sum()) - own_forwarder,
    }


def _profile_kernels(step: Callable[[], object], calls: int) -> Dict[str, Dict[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    table = {}
    for item in prof.key_averages():
        device_us = getattr(item, "device_time_total", None)
        if device_us is None:
            device_us = getattr(item, "cuda_time_total", 0.0)
        if device_us and item.count:
            table[item.key] = {"calls": item.count / calls, "us_per_call": device_us / calls}
    return table


def _rank_main(rank: int, world: int, args) -> Dict:
    os.environ["EP_DISPATCHER_RANKS_PER_NODE"] = str(args.ranks_per_node)
    use_nvshmem_on_one_machine()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    per_node = args.ranks_per_node
    max_tokens = max(args.sweep)
    rdma_bytes = Config().get_rdma_buffer_size_hint(
        args.hidden * 2, world, per_node, num_max_tokens_per_rank=max_tokens
    )
    nvl_bytes = Config(args.num_sms).get_nvl_buffer_size_hint(args.hidden * 2, world)  # checked, not allocated
    buffer = Buffer(None, num_nvl_bytes=nvl_bytes, num_rdma_bytes=rdma_bytes, backend="cuda", validate_inputs=False)
    if "dispatch" not in buffer.engine_calls:
        raise RuntimeError(f"the internode engine is not active (engine calls {buffer.engine_calls})")
    config = Config(args.num_sms)
    results = []
    for tokens in args.sweep:
        x, topk_idx, topk_weights = _routing(rank, tokens, args.hidden, args.experts, args.topk, device)
        x_fp8 = per_token_cast_to_fp8(x)
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
        kwargs = dict(
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            config=config,
        )
        recv, _, _, _, handle, _ = buffer.dispatch(x_fp8, **kwargs)
        num_recv = recv[0].size(0)
        count_matrix = handle.backend_state.count_matrix.cpu()
        rows = _leg_rows(rank, world, per_node, in_rank.cpu(), count_matrix)
        y = torch.randn((num_recv, args.hidden), device=device).to(torch.bfloat16)
        times = time_calls(buffer, args, topk_idx, x, x_fp8, kwargs, handle, y, tokens * world)
        kernels = {}
        if args.profile:
            dist.barrier()
            kernels = _profile_kernels(
                lambda: buffer.combine(y, buffer.dispatch(x_fp8, **kwargs)[4], config=config), args.calls
            )
        fp8_row, bf16_row = args.hidden + args.hidden // 128 * 4, args.hidden * 2
        row_bytes = {
            "dispatch_fp8": fp8_row,
            "dispatch_fp8_worst": fp8_row,
            "cached_dispatch_fp8": fp8_row,
            "dispatch_bf16": bf16_row,
            "combine_bf16": bf16_row,
        }
        legs = {kind: {key: rows[key] * width for key in rows} for kind, width in row_bytes.items()}
        results.append(
            {"tokens": tokens, "num_recv": num_recv, "rows": rows, "times": times, "legs": legs, "kernels": kernels}
        )
    buffer.destroy()
    return {"rank": rank, "results": results}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--ranks-per-node", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--num-sms", type=int, default=16)
    parser.add_argument("--sweep", type=lambda s: [int(v) for v in s.split(",")], default=[4096])
    parser.add_argument("--calls", type=int, default=10, help="back-to-back calls per timed group")
    parser.add_argument("--groups", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="per-kernel times from torch.profiler (rank 0)")
    parser.add_argument("--out", default=None, help="write the full results as JSON here")
    args = parser.parse_args(argv)
    if args.ranks <= args.ranks_per_node or args.ranks % args.ranks_per_node:
        parser.error("--ranks must be a multiple of --ranks-per-node and larger than it (several nodes)")
    per_rank = spawn(_rank_main, args.ranks, args)
    print(
        f"internode: {args.ranks} ranks as {args.ranks // args.ranks_per_node} nodes x {args.ranks_per_node} on "
        f"{min(torch.cuda.device_count(), args.ranks)} GPU(s) ({torch.cuda.get_device_name()}), "
        f"{args.num_sms} SMs/rank, "
        f"hidden {args.hidden}, top-{args.topk} of {args.experts}"
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
            entry = {"tokens": tokens, "kind": kind, "us": t * 1e6}
            line = f"  tokens {tokens:5d} {kind:20s} {t * 1e6:9.1f} us"
            if kind != "layout":
                for leg in ("rdma_logical", "rdma_wire", "nvl_logical", "nvl_wire"):
                    agg = sum(r["legs"][kind][leg] for r in rows)
                    entry[f"{leg}_bytes_per_rank"] = agg / args.ranks
                    entry[f"{leg}_agg_GBps"] = agg / t / 1e9
                for leg, label in (("rdma", "RDMA"), ("nvl", "NVLink")):
                    line += (
                        f" | {label} {entry[f'{leg}_logical_bytes_per_rank'] / 1e6:7.2f} MB/rank logical "
                        f"{entry[f'{leg}_logical_agg_GBps']:7.1f} GB/s, "
                        f"{entry[f'{leg}_wire_bytes_per_rank'] / 1e6:7.2f} wire "
                        f"{entry[f'{leg}_wire_agg_GBps']:7.1f} GB/s"
                    )
            table.append(entry)
            print(line)
        if args.profile:
            print(f"  per-kernel time on rank 0, one FP8 dispatch + BF16 combine, tokens {tokens}:")
            for name, k in sorted(rows[0]["kernels"].items(), key=lambda kv: -kv[1]["us_per_call"]):
                print(f"    {k['us_per_call']:9.1f} us  x{k['calls']:.0f}  {name[:110]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "table": table, "per_rank": per_rank}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
