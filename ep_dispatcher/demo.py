"""End-to-end demo: a small MoE layer over N local ranks, checked against a single-process dense computation.

    python -m ep_dispatcher.demo                 # 4 ranks, gloo on CPU (NCCL when there is a GPU per rank)
    python -m ep_dispatcher.demo --ranks 8 --tokens 512 --hidden 512

Each step routes random tokens (softmax gate, top-k), dispatches them to the ranks that own their experts,
runs each local expert (a 2-layer MLP) on its rows, combines the weighted outputs back and back-propagates.
Every rank also recomputes the whole layer densely (all ranks' tokens, all experts, one process) and compares
outputs and gradients; the report gives the largest difference.
"""

from __future__ import annotations

import argparse
import time
from typing import List

import torch
import torch.distributed as dist

from . import autograd as ep_autograd
from .buffer import Buffer
from .config import Config
from .launch import spawn


def _params(args, device, dtype):
    g = torch.Generator().manual_seed(args.seed)
    scale_in, scale_hidden = args.hidden**-0.5, args.ffn**-0.5
    gate = torch.randn((args.hidden, args.experts), generator=g) * scale_in
    w1 = torch.randn((args.experts, args.hidden, args.ffn), generator=g) * scale_in
    w2 = torch.randn((args.experts, args.ffn, args.hidden), generator=g) * scale_hidden
    return [p.to(device=device, dtype=dtype) for p in (gate, w1, w2)]


def _tokens(args, rank: int, step: int, device, dtype):
    g = torch.Generator().manual_seed(args.seed * 7919 + step * 131 + rank)
    n = args.tokens if rank % 3 != 2 else args.tokens // 2  # uneven ranks, as real batches are
    return torch.randn((n, args.hidden), generator=g).to(device=device, dtype=dtype)


def _route(x, gate, topk: int):
    probs = torch.softmax(x @ gate, dim=-1)
    weights, idx = probs.topk(topk, dim=-1)
    return idx, weights / weights.sum(-1, keepdim=True)


def _experts(x, idx, weights, w1, w2, first_expert: int):
    """``sum_k w_k * mlp_{idx_k}(x)`` over the experts ``first_expert .. first_expert + len(w1)`` (others skipped)."""
    out = torch.zeros_like(x)
    for e in range(w1.size(0)):
        hit = idx == (first_expert + e)
        rows = hit.any(-1).nonzero(as_tuple=True)[0]
        if rows.numel() == 0:
            continue
        weight = (weights * hit).sum(-1, keepdim=True)[rows]
        y = torch.relu(x[rows] @ w1[e]) @ w2[e]
        out = out.index_add(0, rows, weight * y)
    return out


def _rank_main(rank: int, world: int, args) -> dict:
    use_gpu = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if use_gpu else torch.device("cpu")
    dtype = torch.float32
    local = args.experts // world
    nvl_bytes = Config().get_nvl_buffer_size_hint(args.hidden * 4, world)
    buffer = Buffer(None, num_nvl_bytes=nvl_bytes, backend=args.backend)

    gate, w1_all, w2_all = _params(args, device, dtype)
    gate = gate.requires_grad_()
    w1 = w1_all[rank * local : (rank + 1) * local].clone().requires_grad_()
    w2 = w2_all[rank * local : (rank + 1) * local].clone().requires_grad_()

    max_err, step_times, bytes_moved = 0.0, [], 0
    for step in range(args.steps):
        for p in (gate, w1, w2):
            p.grad = None
        x = _tokens(args, rank, step, device, dtype).requires_grad_()
        dist.barrier()
        t0 = time.perf_counter()
        idx, weights = _route(x, gate, args.topk)
        recv_x, recv_idx, recv_w, _, handle = ep_autograd.dispatch(buffer, x, idx, weights.float(), args.experts)
        expert_out = _experts(recv_x, recv_idx, recv_w.to(dtype), w1, w2, first_expert=0)
        out = ep_autograd.combine(buffer, expert_out, handle)
        target = torch.sin(x.detach())
        loss = ((out - target) ** 2).mean()
        loss.backward()
        if use_gpu:
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - t0)
        bytes_moved = 2 * recv_x.numel() * recv_x.element_size()  # received by dispatch + sent back by combine

        # Dense single-process computation of the same step: all ranks' tokens, all experts.
        gate_d = gate.detach().clone().requires_grad_()
        w1_d, w2_d = w1_all.clone().requires_grad_(), w2_all.clone().requires_grad_()
        xs = [_tokens(args, r, step, device, dtype).requires_grad_() for r in range(world)]
        total = 0.0
        outs = []
        for xr in xs:
            idx_d, weights_d = _route(xr, gate_d, args.topk)
            out_d = _experts(xr, idx_d, weights_d, w1_d, w2_d, first_expert=0)
            outs.append(out_d)
            total = total + ((out_d - torch.sin(xr.detach())) ** 2).mean()
        total.backward()
        gate_grad = gate.grad.clone()
        dist.all_reduce(gate_grad)  # each rank's router gradient covers its own tokens only
        errors = [
            (out.detach() - outs[rank].detach()).abs().max(),
            (x.grad - xs[rank].grad).abs().max(),
            (gate_grad - gate_d.grad).abs().max(),
            (w1.grad - w1_d.grad[rank * local : (rank + 1) * local]).abs().max(),
            (w2.grad - w2_d.grad[rank * local : (rank + 1) * local]).abs().max(),
        ]
        max_err = max(max_err, max(float(e) for e in errors if e.numel()))
    return {
        "rank": rank,
        "backend": buffer.backend,
        "device": str(device),
        "tokens": x.size(0),
        "max_err": max_err,
        "step_s": sorted(step_times)[len(step_times) // 2],
        "bytes": bytes_moved,
    }


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank (every third rank has half)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=64)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--backend", default="auto", choices=("auto", "reference", "cuda"))
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest acceptable |difference| (fp32)")
    args = parser.parse_args(argv)
    if args.experts % args.ranks != 0:
        parser.error(f"--experts ({args.experts}) must be a multiple of --ranks ({args.ranks})")
    if args.hidden % 4 != 0:
        parser.error(f"--hidden ({args.hidden}) must be a multiple of 4 (16-byte fp32 rows)")
    pg_backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= args.ranks else "gloo"
    results = spawn(_rank_main, args.ranks, args, backend=pg_backend)
    worst = max(r["max_err"] for r in results)
    print(
        f"ep_dispatcher demo: {args.ranks} ranks ({pg_backend}, backend={results[0]['backend']}, "
        f"{results[0]['device']}), hidden {args.hidden}, {args.experts} experts, top-{args.topk}"
    )
    for r in results:
        print(
            f"  rank {r['rank']}: {r['tokens']:5d} tokens, {r['bytes'] / 1e6:8.3f} MB moved, "
            f"{r['step_s'] * 1e3:7.2f} ms/step (fwd+bwd, median of {args.steps})"
        )
    ok = worst <= args.tolerance
    print(
        f"max |error| vs dense single-process: {worst:.3e} (tolerance {args.tolerance:.0e}) -> {'OK' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
