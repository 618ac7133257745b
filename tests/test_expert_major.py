"""Fused permute (``Buffer.dispatch(..., expert_major=True)``, ``ep_dispatcher/expert_major.py``) on the reference
backend, gloo, 2 and 4 ranks: the expert-major outputs, the combine that reads them, cached dispatch and the autograd
pair are bit-identical to the unfused path (dispatch, then a Megatron-style permute written here independently,
expert compute, un-permute, combine)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ep_dispatcher import Buffer
from ep_dispatcher import autograd as ep_autograd
from ep_dispatcher.expert_major import (
    expert_major_layout,
    permute,
    permute_probs,
    permute_rows,
    unpermute,
    unpermute_sum,
)

from .dist import run


# ---------------------------------------------------------------------------------------------------- helpers
def _routing(num_tokens: int, num_experts: int, num_topk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token, some slots -1; fp32 weights."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:num_topk] for _ in range(num_tokens)])
    idx = idx.masked_fill(torch.rand(idx.shape, generator=g) < 0.2, -1)
    weights = torch.rand(idx.shape, generator=g) * (idx >= 0)
    return idx.to(torch.int64), weights.float()


def _expected_layout(recv_topk_idx: torch.Tensor, num_local_experts: int, alignment: int):
    """Brute force (Python loops): row of each (token, slot) and (token, slot) of each row."""
    rows, num_topk = recv_topk_idx.shape
    row_map = torch.full((rows, num_topk), -1, dtype=torch.int64)
    row_pair = []
    for e in range(num_local_experts):
        pairs = [(t, j) for t in range(rows) for j in range(num_topk) if int(recv_topk_idx[t, j]) == e]
        for t, j in pairs:
            row_map[t, j] = len(row_pair)
            row_pair.append(t * num_topk + j)
        row_pair += [-1] * ((-len(pairs)) % alignment)
    return row_map, torch.tensor(row_pair, dtype=torch.int64)


def _megatron_permute(recv_x: torch.Tensor, recv_topk_idx: torch.Tensor, counts: list[int], alignment: int):
    """What a MoE layer does after an unfused dispatch: each (token, local expert) row, expert-major, received order
    inside an expert, zero rows up to the alignment (written without ep_dispatcher.expert_major)."""
    blocks = []
    for e, aligned in enumerate(counts):
        tokens = (recv_topk_idx == e).any(1).nonzero().squeeze(1)
        block = torch.zeros((aligned, recv_x.size(1)), dtype=recv_x.dtype)
        block[: tokens.numel()] = recv_x[tokens]
        blocks.append(block)
    return torch.cat(blocks) if blocks else recv_x[:0]


def _megatron_unpermute(y: torch.Tensor, recv_topk_idx: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Sum of each token's expert rows: fp32 index_add over the rows in order (CPU: sequential), one rounding."""
    num_tokens = recv_topk_idx.size(0)
    token_of_row, start = [], 0
    for e, aligned in enumerate(counts):
        tokens = (recv_topk_idx == e).any(1).nonzero().squeeze(1).tolist()
        token_of_row += tokens + [-1] * (aligned - len(tokens))
        start += aligned
    token_of_row = torch.tensor(token_of_row, dtype=torch.int64)
    keep = token_of_row >= 0
    out = torch.zeros((num_tokens, y.size(1)), dtype=torch.float32)
    out.index_add_(0, token_of_row[keep], y[keep].float())
    return out.to(y.dtype)


def _experts(rows: torch.Tensor, probs: torch.Tensor, counts: list[int], rank: int) -> torch.Tensor:
    """A per-expert map of the expert-major rows: expert e scales by (rank + e + 1) / 8 and by the row's prob."""
    scale = torch.cat([torch.full((c,), (rank + e + 1) / 8.0) for e, c in enumerate(counts)]) if counts else probs
    return (rows.float() * scale.unsqueeze(1) * probs.unsqueeze(1)).to(rows.dtype)


# ---------------------------------------------------------------------------------------------------- single process
@pytest.mark.parametrize("alignment", [1, 4])
def test_layout_matches_brute_force(alignment):
    g = torch.Generator().manual_seed(11 + alignment)
    num_local_experts, rows, num_topk = 5, 37, 3
    recv_topk_idx = torch.randint(-1, num_local_experts, (rows, num_topk), generator=g)
    for t in range(rows):  # distinct local experts per token, as a dispatch delivers them
        seen = set()
        for j in range(num_topk):
            e = int(recv_topk_idx[t, j])
            if e in seen:
                recv_topk_idx[t, j] = -1
            seen.add(e)
    row_map, row_pair = _expected_layout(recv_topk_idx, num_local_experts, alignment)
    layout = expert_major_layout(recv_topk_idx, num_local_experts, alignment, row_pair.numel())
    assert torch.equal(layout.row_map, row_map) and torch.equal(layout.row_pair, row_pair)

    x = torch.randn(rows, 16, generator=g).bfloat16()
    permuted = permute_rows(x, layout)
    for r, pair in enumerate(row_pair.tolist()):
        expected = x[pair // num_topk] if pair >= 0 else torch.zeros(16, dtype=x.dtype)
        assert torch.equal(permuted[r], expected), r
    y = torch.randn(row_pair.numel(), 16, generator=g).bfloat16()
    y[row_pair < 0] = float("nan")  # padding rows are never read
    summed = unpermute_sum(y, layout)
    for t in range(rows):
        acc = torch.zeros(16)
        for r in sorted(int(v) for v in row_map[t] if v >= 0):
            acc = acc + y[r].float()
        assert torch.equal(summed[t], acc.bfloat16()), t
    probs = torch.rand(rows, num_topk, generator=g)
    flat = probs.reshape(-1)
    expected_probs = torch.where(row_pair >= 0, flat[row_pair.clamp(min=0)], torch.zeros(()))
    assert torch.equal(permute_probs(probs, layout), expected_probs)


def test_layout_without_local_pairs():
    layout = expert_major_layout(torch.full((3, 2), -1, dtype=torch.int64), 4, 8, 0)
    assert layout.num_rows == 0 and layout.row_pair.numel() == 0 and bool((layout.row_map == -1).all())
    assert permute_rows(torch.randn(3, 8), layout).shape == (0, 8)
    assert torch.equal(unpermute_sum(torch.randn(0, 8), layout), torch.zeros(3, 8))


def test_permute_pair_is_adjoint_and_deterministic():
    """permute's backward is unpermute_sum and vice versa (fp64: <P x, y> == <x, U y> up to rounding)."""
    g = torch.Generator().manual_seed(5)
    recv_topk_idx = torch.tensor([[0, 2, -1], [1, -1, 0], [2, 1, 0], [-1, -1, -1]])
    layout = expert_major_layout(recv_topk_idx, 3, 2, 12)
    x = torch.randn(4, 8, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randn(12, 8, dtype=torch.float64, generator=g, requires_grad=True)
    torch.autograd.gradcheck(lambda t: permute(t, layout), (x,))
    torch.autograd.gradcheck(lambda t: unpermute(t, layout), (y,))


# ---------------------------------------------------------------------------------------------------- multi-rank
def _fused_vs_unfused(rank: int, world: int, dtype_name: str, alignment: int, seed: int) -> None:
    dtype = getattr(torch, dtype_name)
    num_tokens, hidden, num_topk, num_local = 29, 32, 4, 3
    num_experts = num_local * world
    buffer = Buffer(dist.group.WORLD, backend="reference")
    topk_idx, topk_weights = _routing(num_tokens, num_experts, num_topk, seed * 100 + rank)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed + rank)).to(dtype)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    common = dict(
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        expert_alignment=alignment,
    )
    recv_x, recv_idx, recv_w, counts, handle, _ = buffer.dispatch(x, **common)
    em_x, em_idx, em_w, em_counts, em_handle, _ = buffer.dispatch(x, expert_major=True, **common)

    # Dispatch: the same received top-k and counts; the rows are the Megatron-style permute of recv_x.
    assert torch.equal(em_idx, recv_idx) and torch.equal(em_w, recv_w) and em_counts == counts
    assert em_handle.expert_major is not None and handle.expert_major is None
    assert sum(counts) % 1 == 0 and all(c % alignment == 0 for c in counts)
    expected = _megatron_permute(recv_x, recv_idx, counts, alignment)
    assert em_x.shape == (sum(counts), hidden) and torch.equal(em_x, expected)
    assert torch.equal(em_handle.num_recv_tokens_per_expert, handle.num_recv_tokens_per_expert)

    # Combine of expert-major expert outputs == un-permute (fp32, fixed order) then combine.
    probs = permute_probs(recv_w, em_handle.expert_major)
    y = _experts(em_x, probs, counts, rank)
    combined_fused, w_fused, _ = buffer.combine(y, em_handle, topk_weights=recv_w)
    combined_unfused, w_unfused, _ = buffer.combine(
        _megatron_unpermute(y, recv_idx, counts), handle, topk_weights=recv_w
    )
    assert torch.equal(combined_fused, combined_unfused)
    assert torch.equal(w_fused, w_unfused)
    # Padding rows are not read: garbage there changes nothing.
    pad = em_handle.expert_major.row_pair < 0
    if bool(pad.any()):
        y_garbage = y.clone()
        y_garbage[pad] = float("nan")
        garbage_combined, _, _ = buffer.combine(y_garbage, em_handle)
        assert torch.equal(garbage_combined, combined_fused)

    # Cached dispatch with the expert-major handle == permute of the received-order cached dispatch.
    z = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed + 7 + rank)).to(dtype)
    cached_em, *_ = buffer.dispatch(z, handle=em_handle)
    cached, *_ = buffer.dispatch(z, handle=handle)
    assert torch.equal(cached_em, _megatron_permute(cached, recv_idx, counts, alignment))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype_name,alignment", [("bfloat16", 1), ("bfloat16", 4), ("float32", 3)])
def test_fused_matches_unfused(world, dtype_name, alignment):
    run(_fused_vs_unfused, world, dtype_name, alignment, 31 + world)


def _autograd_fused_vs_unfused(rank: int, world: int, dtype_name: str, alignment: int) -> None:
    dtype = getattr(torch, dtype_name)
    num_tokens, hidden, num_topk, num_local = 23, 16, 6, 4  # up to 4 local experts per token: sums of >= 3 rows
    num_experts = num_local * world
    buffer = Buffer(dist.group.WORLD, backend="reference")
    topk_idx, weights0 = _routing(num_tokens, num_experts, num_topk, 900 + rank)
    x0 = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(77 + rank)).to(dtype)
    grad_out = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(99 + rank)).to(dtype)

    def step(fused: bool):
        x = x0.clone().requires_grad_(True)
        w = weights0.clone().requires_grad_(True)
        recv_x, recv_idx, recv_w, counts, handle = ep_autograd.dispatch(
            buffer, x, topk_idx, w, num_experts, expert_alignment=alignment, expert_major=fused
        )
        if fused:
            layout = handle.expert_major
            expert_in = recv_x
        else:
            layout = expert_major_layout(recv_idx, num_local, alignment, sum(counts))
            expert_in = permute(recv_x, layout)  # the separate permute pass (deterministic fp32 backward)
        y = _experts(expert_in, permute_probs(recv_w, layout), counts, rank)
        y_tokens = y if fused else unpermute(y, layout)  # the separate un-permute pass
        out = ep_autograd.combine(buffer, y_tokens, handle)
        out.backward(grad_out)
        return out.detach(), x.grad, w.grad

    fused, unfused = step(True), step(False)
    for name, a, b in zip(("output", "grad x", "grad topk_weights"), fused, unfused):
        assert a is not None and b is not None, name
        assert torch.equal(a, b), name  # bit-identical: the same reductions in the same order


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype_name,alignment", [("bfloat16", 1), ("bfloat16", 8), ("float32", 1)])
def test_autograd_fused_matches_unfused(world, dtype_name, alignment):
    run(_autograd_fused_vs_unfused, world, dtype_name, alignment)


def _fp8_payload(rank: int, world: int) -> None:
    num_tokens, hidden, num_topk, num_experts = 19, 256, 2, 2 * world
    buffer = Buffer(dist.group.WORLD, backend="reference")
    topk_idx, topk_weights = _routing(num_tokens, num_experts, num_topk, 40 + rank)
    g = torch.Generator().manual_seed(rank)
    data = (torch.randn(num_tokens, hidden, generator=g) * 4).to(torch.float8_e4m3fn)
    scales = torch.rand(num_tokens, hidden // 128, generator=g) + 0.5
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    common = dict(
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        expert_alignment=2,
    )
    (recv_data, recv_scales), recv_idx, _, counts, _, _ = buffer.dispatch((data, scales), **common)
    (em_data, em_scales), *_ = buffer.dispatch((data, scales), expert_major=True, **common)
    expected = _megatron_permute(recv_data.view(torch.uint8), recv_idx, counts, 2)
    assert torch.equal(em_data.view(torch.uint8), expected)
    assert torch.equal(em_scales, _megatron_permute(recv_scales, recv_idx, counts, 2))


def test_fp8_payload_expert_major():
    run(_fp8_payload, 2)


def _bad_inputs(rank: int, world: int) -> None:
    num_tokens, hidden, num_experts = 8, 16, 2 * world
    buffer = Buffer(dist.group.WORLD, backend="reference")
    topk_idx, topk_weights = _routing(num_tokens, num_experts, 2, rank)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(rank)).bfloat16()
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    with pytest.raises(TypeError, match="expert_major: expected a bool, got int"):
        buffer.dispatch(x, **layout, topk_idx=topk_idx, topk_weights=topk_weights, expert_major=1)
    with pytest.raises(ValueError, match="expert_major: needs topk_idx"):
        buffer.dispatch(x, **layout, expert_major=True)
    with pytest.raises(ValueError, match="expert_major: not available with num_worst_tokens=64"):
        buffer.dispatch(
            x, **layout, topk_idx=topk_idx, topk_weights=topk_weights, num_worst_tokens=64, expert_major=True
        )
    recv_x, _, _, counts, handle, _ = buffer.dispatch(x, **layout, topk_idx=topk_idx, topk_weights=topk_weights)
    with pytest.raises(ValueError, match="expert_major: the handle comes from a received-order dispatch"):
        buffer.dispatch(x, handle=handle, expert_major=True)
    em_x, _, _, _, em_handle, _ = buffer.dispatch(
        x, **layout, topk_idx=topk_idx, topk_weights=topk_weights, expert_major=True
    )
    if em_x.size(0) != recv_x.size(0):  # a received-order input is refused by its row count
        with pytest.raises(ValueError, match=r"^x: expected shape"):
            buffer.combine(recv_x, em_handle)
    buffer.combine(em_x, em_handle)  # the collectives stay matched on every rank


def test_bad_inputs():
    run(_bad_inputs, 2)
