"""The expert-major receive layout (fused permute): the specification, in plain PyTorch.

A normal dispatch returns the received tokens in *received order* (source rank ascending, source order kept inside a
rank), once per token. A MoE layer then permutes them *expert-major* (each token once per local expert it picked,
grouped by local expert) before the grouped GEMM, and un-permutes the expert outputs (summing a token's local-expert
rows) before combine. ``Buffer.dispatch(..., expert_major=True)`` returns the expert-major tensor directly and
``Buffer.combine`` reads from it, so no separate permute pass exists.

Layout (``L`` local experts, ``count[e]`` pairs (received token, top-k slot) that picked local expert ``e``,
``aligned[e]`` = ``count[e]`` rounded up to ``expert_alignment``):

* expert ``e`` owns rows ``[base[e], base[e] + aligned[e])`` with ``base[e] = aligned[0] + ... + aligned[e-1]``;
  ``M = sum(aligned)`` rows in all (= the sum of the dispatch's count list);
* inside expert ``e`` the pairs keep the received order: the row of a pair is ``base[e]`` + the number of tokens of
  earlier source ranks for ``e`` + the token's position among its source rank's tokens for ``e`` (a per-expert scan
  on the sender gives the last term, as the per-rank send positions do for received order);
* the ``aligned[e] - count[e]`` rows at the end of each expert are padding, filled with zeros.

``row_map [R, k] int64``: the row of each (received token, slot), ``-1`` where the slot's expert is not local.
``row_pair [M] int64``: the inverse, ``token * k + slot`` of each row, ``-1`` for padding rows.

Combine of an expert-major ``y [M, H]`` first reduces, per received token, its local-expert rows in local-expert
order (= row order), ``acc = 0 + y_row`` in fp32 (fp64 for fp64), rounded once to ``y.dtype`` -- exactly the
un-permute a MoE layer does before an unfused combine -- then runs the normal combine. Both passes are therefore
bit-identical to dispatch -> permute -> experts -> un-permute -> combine with that un-permute, and combine's
accumulation order across ranks is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

_FLOAT8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


@dataclass(frozen=True)
class ExpertMajorLayout:
    """Where each received (token, top-k slot) lies in the expert-major tensor (see the module docstring).

    Attributes:
        row_map: ``[num_recv_tokens, num_topk] int64``, row of each pair, ``-1`` for non-local slots.
        row_pair: ``[num_rows] int64``, ``token * num_topk + slot`` of each row, ``-1`` for padding rows.
        num_rows: ``M`` (host int), rows of the expert-major tensor.
        num_topk: ``k``.
        expert_alignment: the per-expert row alignment the layout was made with.
    """

    row_map: torch.Tensor
    row_pair: torch.Tensor
    num_rows: int
    num_topk: int
    expert_alignment: int

    @property
    def num_recv_tokens(self) -> int:
        return self.row_map.size(0)


def expert_major_layout(
    recv_topk_idx: torch.Tensor, num_local_experts: int, expert_alignment: int, num_rows: int
) -> ExpertMajorLayout:
    """The expert-major layout of a dispatch's received top-k ids (no host sync).

    Args:
        recv_topk_idx: ``[num_recv_tokens, num_topk] int64`` local expert ids, ``-1`` = expert elsewhere.
        num_local_experts: ``L``.
        expert_alignment: rows per expert are rounded up to a multiple of it.
        num_rows: ``M`` = sum of the aligned per-expert counts (the dispatch's host count list), so nothing here
            waits for the device.
    """
    num_tokens, num_topk = recv_topk_idx.shape
    device = recv_topk_idx.device
    flat = recv_topk_idx.reshape(-1)
    is_local = flat >= 0
    key = torch.where(is_local, flat, torch.full_like(flat, num_local_experts))  # non-local pairs sort last
    # Stable: inside an expert, pairs keep flat order = received-token order (a token names an expert once per slot).
    sorted_key, order = torch.sort(key, stable=True)
    counts = torch.bincount(key, minlength=num_local_experts + 1)
    starts = torch.cumsum(counts, 0) - counts
    aligned = (counts[:num_local_experts] + expert_alignment - 1) // expert_alignment * expert_alignment
    base = torch.cat([torch.cumsum(aligned, 0) - aligned, aligned.new_full((1,), num_rows)])
    position = torch.arange(flat.numel(), device=device) - starts[sorted_key]
    row_sorted = torch.where(sorted_key < num_local_experts, base[sorted_key] + position, -1)
    row_map = torch.empty_like(flat)
    row_map[order] = row_sorted
    # Non-local pairs all land on the spare row num_rows, which is cut off (whichever write wins there is unused).
    row_pair = torch.full((num_rows + 1,), -1, dtype=torch.int64, device=device)
    row_pair[torch.where(row_sorted >= 0, row_sorted, num_rows)] = order
    return ExpertMajorLayout(
        row_map=row_map.view(num_tokens, num_topk),
        row_pair=row_pair[:num_rows],
        num_rows=num_rows,
        num_topk=num_topk,
        expert_alignment=expert_alignment,
    )


def to_expert_major(dispatch_result: tuple, num_local_experts: int, expert_alignment: int) -> tuple:
    """A normal dispatch's result ``(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert_list,
    handle)`` made expert-major: ``recv_x`` / ``recv_x_scales`` permuted to ``[M, ...]`` rows, the top-k outputs and
    the count list as they are, and a new handle carrying the layout (``handle.expert_major``). This is the
    specification of ``dispatch(..., expert_major=True)``; the reference backend and the CUDA backend's fallback both
    run it."""
    recv, recv_scales, recv_topk_idx, recv_topk_weights, per_expert_list, handle = dispatch_result
    layout = expert_major_layout(recv_topk_idx, num_local_experts, expert_alignment, sum(per_expert_list))
    return (
        permute_rows(recv, layout),
        permute_rows(recv_scales, layout),
        recv_topk_idx,
        recv_topk_weights,
        per_expert_list,
        handle.with_expert_major(layout),
    )


def _zero_rows_(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``t[rows] = 0`` in place (``rows`` a ``[len(t)] bool`` mask), any dtype (float8 through its bytes)."""
    target = t.view(torch.uint8) if t.dtype in _FLOAT8_DTYPES else t
    target.masked_fill_(rows.view(-1, *([1] * (t.dim() - 1))), 0)
    return t


def permute_rows(recv: Optional[torch.Tensor], layout: ExpertMajorLayout) -> Optional[torch.Tensor]:
    """``[num_recv_tokens, ...]`` (received order) -> ``[M, ...]`` expert-major; padding rows are zeros. Bit copies."""
    if recv is None:
        return None
    token = layout.row_pair.div(layout.num_topk, rounding_mode="floor")
    if recv.size(0) == 0:
        return recv.new_zeros((layout.num_rows, *recv.shape[1:]))
    out = recv.index_select(0, token.clamp(min=0))
    return _zero_rows_(out, layout.row_pair < 0)


def unpermute_sum(y: torch.Tensor, layout: ExpertMajorLayout) -> torch.Tensor:
    """``y [M, H]`` expert-major -> ``[num_recv_tokens, H]`` of ``y.dtype``: per token, ``0 + y_row`` over its rows in
    row order (= local-expert order), fp32 (fp64 for fp64), one rounding. A token without a local row gets zeros."""
    acc_dtype = torch.float64 if y.dtype == torch.float64 else torch.float32
    num_tokens = layout.num_recv_tokens
    acc = torch.zeros((num_tokens, *y.shape[1:]), dtype=acc_dtype, device=y.device)
    if layout.num_rows == 0 or num_tokens == 0:
        return acc.to(y.dtype)
    # Each token's rows in ascending order (expert-major: ascending row = ascending local expert); -1 sorts last.
    rows = torch.where(layout.row_map >= 0, layout.row_map, layout.num_rows)
    rows = torch.sort(rows, dim=1).values
    for slot in range(rows.size(1)):
        row = rows[:, slot]
        present = (row < layout.num_rows).view(-1, *([1] * (y.dim() - 1)))
        acc = torch.where(present, acc + y.index_select(0, row.clamp(max=layout.num_rows - 1)).to(acc_dtype), acc)
    return acc.to(y.dtype)


def permute_probs(recv_topk_weights: torch.Tensor, layout: ExpertMajorLayout) -> torch.Tensor:
    """``[num_recv_tokens, k]`` per-slot values (e.g. gate weights) -> ``[M]`` per expert-major row, 0 on padding.
    Differentiable: each pair appears in one row, so the gradient is a scatter without sums."""
    flat = recv_topk_weights.reshape(-1)
    padded = torch.cat([flat, flat.new_zeros(1)])  # the padding rows read the constant at the end
    return padded.index_select(0, torch.where(layout.row_pair >= 0, layout.row_pair, flat.numel()))


class _Move(torch.autograd.Function):
    """A move between received and expert-major rows (``permute_rows`` / ``unpermute_sum``); backward = the other one
    (``unpermute_sum`` is fp32 in a fixed order: deterministic; ``permute_rows`` copies a row, padding rows zero)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layout: ExpertMajorLayout, move: Callable, opposite: Callable) -> torch.Tensor:
        ctx.layout, ctx.opposite = layout, opposite
        return move(x, layout)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.opposite(grad.contiguous(), ctx.layout), None, None, None


def permute(recv_x: torch.Tensor, layout: ExpertMajorLayout) -> torch.Tensor:
    """Differentiable :func:`permute_rows` (the unfused path's separate permute pass)."""
    return _Move.apply(recv_x, layout, permute_rows, unpermute_sum)


def unpermute(y: torch.Tensor, layout: ExpertMajorLayout) -> torch.Tensor:
    """Differentiable :func:`unpermute_sum` (the unfused path's separate un-permute pass)."""
    return _Move.apply(y, layout, unpermute_sum, permute_rows)
