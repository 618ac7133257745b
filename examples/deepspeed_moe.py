"""Tiny transformer with DeepSpeed-MoE layers, trained through ``deepspeed.initialize``: ours vs DeepSpeed's.

    python examples/deepspeed_moe.py                  # 2 ranks: gloo on CPU, NCCL when there is one GPU per rank
    python examples/deepspeed_moe.py --ranks 4 --steps 8 --experts 8 --topk 2

The only difference between the two runs is the import of the MoE class::

    from deepspeed.moe.layer import MoE            # DeepSpeed's dispatch (capacity-padded buffers, all-to-all)
    from ep_dispatcher.deepspeed import MoE        # ep_dispatcher's dispatch/combine (routed tokens only)

Both runs start from the same weights and data and draw the same gate noise, so the losses per step agree to fp32
rounding. Prints one line per step and the largest difference.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import List

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout too

from ep_dispatcher.launch import spawn  # noqa: E402


class Block(nn.Module):
    def __init__(self, moe_cls, args, ep_size: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(args.hidden)
        self.attn = nn.MultiheadAttention(args.hidden, args.heads, batch_first=True)
        self.norm2 = nn.LayerNorm(args.hidden)
        ffn = 4 * args.hidden
        expert = nn.Sequential(nn.Linear(args.hidden, ffn), nn.GELU(), nn.Linear(ffn, args.hidden))
        self.moe = moe_cls(
            args.hidden,
            expert,
            num_experts=args.experts,
            ep_size=ep_size,
            k=args.topk,
            capacity_factor=args.capacity_factor,
            min_capacity=0,
            drop_tokens=args.capacity_factor > 0,
        )

    def forward(self, x: torch.Tensor, causal_mask: torch.Tensor):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal_mask, need_weights=False)[0]
        y, l_aux, _ = self.moe(self.norm2(x))
        return x + y, l_aux


class TinyMoETransformer(nn.Module):
    def __init__(self, moe_cls, args, ep_size: int):
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.hidden)
        self.blocks = nn.ModuleList(Block(moe_cls, args, ep_size) for _ in range(args.layers))
        self.norm = nn.LayerNorm(args.hidden)
        self.head = nn.Linear(args.hidden, args.vocab)

    def forward(self, tokens: torch.Tensor):
        seq = tokens.size(1)
        causal_mask = torch.triu(torch.full((seq, seq), float("-inf"), device=tokens.device), diagonal=1)
        x = self.embed(tokens)
        l_aux_total = x.new_zeros(())
        for block in self.blocks:
            x, l_aux = block(x, causal_mask)
            l_aux_total = l_aux_total + l_aux
        return self.head(self.norm(x)), l_aux_total


def _batch(args, step: int, rank: int, device: torch.device):
    """A learnable toy task: predict the previous token plus one (mod vocab)."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    targets = (tokens[:, :-1] + 1) % args.vocab
    return tokens[:, 1:].to(device), targets.to(device)


def train(rank: int, world: int, args, ours: bool) -> List[float]:
    """Train ``args.steps`` steps; returns the loss of each step averaged over the ranks."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    import deepspeed

    on_gpu = torch.cuda.is_available() and "nccl" in dist.get_backend()
    if on_gpu:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    if not on_gpu:
        # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce on first use (~30 s); gloo serves here.
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    if ours:
        from ep_dispatcher.deepspeed import MoE
    else:
        from deepspeed.moe.layer import MoE

    torch.manual_seed(args.seed)  # same dense weights and gates on every rank (data parallel)
    model = TinyMoETransformer(MoE, args, ep_size=world)
    for block in model.blocks:  # each global expert its own weights: rank r holds experts r*L .. r*L+L-1
        local_experts = block.moe.deepspeed_moe.experts.deepspeed_experts
        for local, expert in enumerate(local_experts):
            g = torch.Generator().manual_seed(args.seed + 1 + rank * len(local_experts) + local)
            with torch.no_grad():
                for p in expert.parameters():
                    p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    losses = []
    for step in range(args.steps):
        tokens, targets = _batch(args, step, rank, device)
        torch.manual_seed(args.seed + 7 * step + rank)  # the gates' noise: the same draws in both runs
        logits, l_aux = engine(tokens)
        loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1)) + args.aux_coef * l_aux
        engine.backward(loss)
        engine.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(float(mean_loss) / world)
    return losses


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="expert-parallel ranks (processes)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.0, help="0 = no token drops")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--aux-coef", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    return p.parse_args(argv)


def main(argv=None) -> float:
    args = parse_args(argv)
    if args.experts % args.ranks != 0:
        raise SystemExit(f"--experts ({args.experts}) must be a multiple of --ranks ({args.ranks})")
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= args.ranks else "gloo"
    if backend == "nccl":
        backend = "cpu:gloo,cuda:nccl"  # the reference backend gathers counts on the host
    theirs = spawn(train, args.ranks, args, False, backend=backend)[0]
    ours = spawn(train, args.ranks, args, True, backend=backend)[0]
    print(
        f"ranks {args.ranks} ({backend}), experts {args.experts}, top-{args.topk}, hidden {args.hidden}, "
        f"{args.batch}x{args.seq} tokens per rank, capacity factor {args.capacity_factor}"
    )
    print(f"{'step':>4}  {'deepspeed loss':>14}  {'ep_dispatcher loss':>18}  {'|diff|':>8}")
    for step, (a, b) in enumerate(zip(theirs, ours)):
        print(f"{step:>4}  {a:>14.6f}  {b:>18.6f}  {abs(a - b):>8.1e}")
    max_diff = max(abs(a - b) for a, b in zip(theirs, ours))
    print(f"max |diff| {max_diff:.2e}")
    return max_diff


if __name__ == "__main__":
    main()
