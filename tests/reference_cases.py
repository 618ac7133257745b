"""Random routing cases and an independent, loop-level statement of the expected results.

Every rank regenerates every rank's inputs from the case seed, so each rank can compute what it must receive
without communication. The expectations here are written from DESIGN.md's semantics, not from the backend
code, so a backend bug cannot hide in a shared helper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch


@dataclass
class Case:
    seed: int
    num_ranks: int
    num_experts: int
    num_topk: int
    hidden: int
    tokens_per_rank: List[int]
    minus_one_fraction: float
    skewed: bool

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.num_ranks


def random_case(seed: int, num_ranks: int, max_tokens: int = 300, hidden_choices=(128, 256, 384, 512, 1024)) -> Case:
    g = torch.Generator().manual_seed(seed)
    pick = lambda seq: seq[int(torch.randint(len(seq), (1,), generator=g))]  # noqa: E731
    experts_choices = [e for e in (8, 16, 24, 32, 64) if e % num_ranks == 0 and e >= num_ranks]
    num_experts = pick(experts_choices)
    num_topk = int(torch.randint(1, min(9, num_experts) + 1, (1,), generator=g))
    tokens = [int(torch.randint(0, max_tokens + 1, (1,), generator=g)) for _ in range(num_ranks)]
    if num_ranks > 1 and seed % 3 == 0:
        tokens[seed % num_ranks] = 0  # a rank with nothing to send
    return Case(
        seed=seed,
        num_ranks=num_ranks,
        num_experts=num_experts,
        num_topk=num_topk,
        hidden=pick(hidden_choices),
        tokens_per_rank=tokens,
        minus_one_fraction=pick((0.0, 0.1, 0.3)),
        skewed=bool(seed % 2),
    )


def rank_inputs(case: Case, rank: int):
    """``(x bf16 [N, H], topk_idx int64 [N, k], topk_weights fp32 [N, k])`` of ``rank`` in ``case``."""
    g = torch.Generator().manual_seed(case.seed * 1000 + rank)
    n, k, e = case.tokens_per_rank[rank], case.num_topk, case.num_experts
    x = (torch.randn((n, case.hidden), generator=g) * 3).to(torch.bfloat16)
    scores = torch.rand((n, e), generator=g)
    if case.skewed:
        scores[:, : max(k, case.num_local_experts)] += 2.0  # most tokens pile onto rank 0's experts
    topk_idx = scores.topk(k, dim=1).indices  # distinct experts per token
    drop = torch.rand((n, k), generator=g) < case.minus_one_fraction
    topk_idx = torch.where(drop, torch.full_like(topk_idx, -1), topk_idx)
    topk_weights = torch.rand((n, k), generator=g) + 0.1
    return x, topk_idx, topk_weights


def expected_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int):
    """Loop-level ``(num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank)``."""
    n = topk_idx.size(0)
    local = num_experts // num_ranks
    per_rank = torch.zeros(num_ranks, dtype=torch.int32)
    per_expert = torch.zeros(num_experts, dtype=torch.int32)
    in_rank = torch.zeros((n, num_ranks), dtype=torch.bool)
    for t in range(n):
        for e in topk_idx[t].tolist():
            if e >= 0:
                per_expert[e] += 1
                in_rank[t, e // local] = True
    per_rank += in_rank.sum(0).to(torch.int32)
    return per_rank, per_expert, in_rank


def expected_dispatch(case: Case, me: int, all_inputs):
    """What rank ``me`` receives: rows of every source rank ascending, source order kept."""
    local = case.num_local_experts
    xs, topks, weights, srcs = [], [], [], []
    for src in range(case.num_ranks):
        x, topk_idx, topk_weights = all_inputs[src]
        for t in range(x.size(0)):
            ids = topk_idx[t].tolist()
            if not any(e >= 0 and e // local == me for e in ids):
                continue
            xs.append(x[t])
            mine = [e - me * local if e >= 0 and e // local == me else -1 for e in ids]
            topks.append(torch.tensor(mine, dtype=torch.int64))
            weights.append(torch.where(torch.tensor(mine) >= 0, topk_weights[t], torch.zeros_like(topk_weights[t])))
            srcs.append(t)
    h, k = case.hidden, case.num_topk
    stack = lambda items, shape, dtype: torch.stack(items) if items else torch.empty(shape, dtype=dtype)  # noqa: E731
    recv_x = stack(xs, (0, h), torch.bfloat16)
    recv_topk = stack(topks, (0, k), torch.int64)
    recv_w = stack(weights, (0, k), torch.float32)
    counts = [int((recv_topk == e).sum()) for e in range(local)]
    return recv_x, recv_topk, recv_w, torch.tensor(srcs, dtype=torch.int32), counts


def expert_fn(rank: int, x: torch.Tensor) -> torch.Tensor:
    """The stand-in expert computation of ``rank`` in combine tests (distinct per rank, exact in bf16 semantics)."""
    return (x.float() * (rank + 1) - 0.5).to(x.dtype)


def expected_combine(case: Case, me: int, all_inputs, biases=()):
    """``bias_0 + bias_1 + sum over ranks r ascending holding the token of expert_fn(r, x)``, fp32, one rounding."""
    x, topk_idx, topk_weights = all_inputs[me]
    local = case.num_local_experts
    acc = torch.zeros((x.size(0), case.hidden), dtype=torch.float32)
    for b in biases:
        acc += b.float()
    weights_back = torch.zeros_like(topk_weights)
    for t in range(x.size(0)):
        ranks = sorted({e // local for e in topk_idx[t].tolist() if e >= 0})
        for r in ranks:
            acc[t] = acc[t] + expert_fn(r, x[t : t + 1])[0].float()
            mask = torch.tensor([e >= 0 and e // local == r for e in topk_idx[t].tolist()])
            weights_back[t] = weights_back[t] + torch.where(mask, topk_weights[t], torch.zeros_like(topk_weights[t]))
    return acc.to(x.dtype), weights_back


def expected_combine_by_node(case: Case, me: int, all_inputs, num_ranks_per_node: int, biases=()):
    """Multi-node combine order, element by element: per node holding the token, an fp32 partial over its ranks
    ascending, rounded to bf16; then ``0 + bias_0 + bias_1 + partials`` over nodes ascending in fp32, one rounding.
    Weights: ``0 + sum over nodes of (0 + sum over the node's ranks)`` in fp32."""
    x, topk_idx, topk_weights = all_inputs[me]
    local = case.num_local_experts
    out = torch.empty((x.size(0), case.hidden), dtype=x.dtype)
    weights_back = torch.zeros_like(topk_weights)
    for t in range(x.size(0)):
        ranks = sorted({e // local for e in topk_idx[t].tolist() if e >= 0})
        nodes = sorted({r // num_ranks_per_node for r in ranks})
        rows = {r: expert_fn(r, x[t : t + 1])[0].float() for r in ranks}
        for c in range(case.hidden):
            acc = torch.tensor(0.0, dtype=torch.float32)
            for b in biases:
                acc = acc + b[t, c].float()
            for n in nodes:
                partial = torch.tensor(0.0, dtype=torch.float32)
                for r in ranks:
                    if r // num_ranks_per_node == n:
                        partial = partial + rows[r][c]
                acc = acc + partial.to(x.dtype).float()
            out[t, c] = acc.to(x.dtype)
        for k in range(case.num_topk):
            acc_w = torch.tensor(0.0, dtype=torch.float32)
            for n in nodes:
                partial_w = torch.tensor(0.0, dtype=torch.float32)
                for r in ranks:
                    if r // num_ranks_per_node != n:
                        continue
                    # Rank r's row carries the weight for its own expert, 0 for experts elsewhere.
                    is_mine = int(topk_idx[t, k]) >= 0 and int(topk_idx[t, k]) // local == r
                    partial_w = partial_w + (topk_weights[t, k] if is_mine else 0.0)
                acc_w = acc_w + partial_w
            weights_back[t, k] = acc_w
    return out, weights_back


def expected_low_latency_layout(case: Case, dest: int, all_inputs, max_tokens: int):
    """For rank ``dest``: per local expert the list of (src rank, token) in slot order, and per-(expert, src) counts."""
    local = case.num_local_experts
    slots = [[] for _ in range(local)]
    for src in range(case.num_ranks):
        _, topk_idx, _ = all_inputs[src]
        for e in range(local):
            g = dest * local + e
            for t in range(topk_idx.size(0)):
                for k in range(case.num_topk):
                    if int(topk_idx[t, k]) == g:
                        slots[e].append((src, t))
    return slots
