"""Differentiable dispatch and combine.

``dispatch`` and ``combine`` are linear maps and each is the other's adjoint:
* dispatch's backward is a combine of the gradients (rows summed back to their source token), and the top-k
  weight gradients are summed back the same way to ``[num_tokens, num_topk]``;
* combine's backward is a cached dispatch of the output gradient with the same handle.
Handles live on ``ctx`` (each call's own), never on shared objects, so several micro-batches can be in flight.
Both passes are collectives: every rank must run the backward of every dispatch/combine it ran forward (a rank
whose loss ignores an output still gets a zero gradient, so the collectives stay matched).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .buffer import Buffer
from .config import Config
from .handles import DispatchHandle


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        buffer: Buffer,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        num_experts: int,
        expert_alignment: int,
        num_worst_tokens: int,
        config: Optional[Config],
        combine_config: Optional[Config],
        expert_major: bool,
    ):
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_topk_idx, recv_topk_weights, counts, handle, _ = buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            expert_alignment=expert_alignment,
            num_worst_tokens=num_worst_tokens,
            config=config,
            expert_major=expert_major,
        )
        ctx.buffer, ctx.handle, ctx.combine_config = buffer, handle, combine_config
        ctx.recv_x_meta = (recv_x.shape, recv_x.dtype, recv_x.device)
        ctx.set_materialize_grads(False)  # an unused weight output then costs no sum-back
        ctx.save_for_backward(recv_topk_idx)
        ctx.mark_non_differentiable(recv_topk_idx)
        return recv_x, recv_topk_idx, recv_topk_weights, counts, handle

    @staticmethod
    def backward(ctx, grad_recv_x, _grad_topk_idx, grad_recv_topk_weights, _grad_counts, _grad_handle):
        (recv_topk_idx,) = ctx.saved_tensors
        handle: DispatchHandle = ctx.handle
        if grad_recv_x is None:
            # Still combine (zeros): the other ranks' backward is the same collective.
            shape, dtype, device = ctx.recv_x_meta
            grad_recv_x = torch.zeros(shape, dtype=dtype, device=device)
        if grad_recv_topk_weights is not None:
            # Weights of experts on other ranks (and padding rows) are constants 0 here: no gradient flows to them.
            grad_recv_topk_weights = grad_recv_topk_weights.masked_fill(recv_topk_idx < 0, 0).float().contiguous()
        grad_x, grad_topk_weights, _ = ctx.buffer.combine(
            grad_recv_x.contiguous(), handle, topk_weights=grad_recv_topk_weights, config=ctx.combine_config
        )
        return None, grad_x, None, grad_topk_weights, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        buffer: Buffer,
        x: torch.Tensor,
        handle: DispatchHandle,
        bias: Optional[torch.Tensor],
        config: Optional[Config],
        dispatch_config: Optional[Config],
    ):
        combined, _, _ = buffer.combine(x, handle, bias=bias, config=config)
        ctx.buffer, ctx.handle, ctx.dispatch_config = buffer, handle, dispatch_config
        ctx.has_bias = bias is not None
        ctx.combined_meta = (combined.shape, combined.dtype, combined.device)
        ctx.set_materialize_grads(False)
        return combined

    @staticmethod
    def backward(ctx, grad_combined):
        if grad_combined is None:
            shape, dtype, device = ctx.combined_meta
            grad_combined = torch.zeros(shape, dtype=dtype, device=device)
        grad_x, _, _, _, _, _ = ctx.buffer.dispatch(
            grad_combined.contiguous(), handle=ctx.handle, config=ctx.dispatch_config
        )
        return None, grad_x, None, (grad_combined if ctx.has_bias else None), None, None


def dispatch(
    buffer: Buffer,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    expert_alignment: int = 1,
    num_worst_tokens: int = 0,
    config: Optional[Config] = None,
    combine_config: Optional[Config] = None,
    expert_major: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[int], DispatchHandle]:
    """Differentiable ``Buffer.dispatch`` (layout computed inside).

    Args:
        x: ``[num_tokens, hidden]`` floating point; topk_idx ``[num_tokens, num_topk] int64``;
            topk_weights ``[num_tokens, num_topk] float32``.
        expert_major: fused permute (``Buffer.dispatch(..., expert_major=True)``): ``recv_x`` is expert-major
            ``[M, hidden]`` with ``expert_alignment`` padding rows, ``handle.expert_major`` its layout; pass the
            expert outputs to :func:`combine` in that layout. The backward is the fused un-permute + combine, and
            :func:`combine`'s backward a cached dispatch straight into expert-major rows.
    Returns:
        ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle)``; gradients flow to
        ``x`` and ``topk_weights``.
    """
    return _Dispatch.apply(
        buffer,
        x,
        topk_idx,
        topk_weights,
        num_experts,
        expert_alignment,
        num_worst_tokens,
        config,
        combine_config,
        expert_major,
    )


def combine(
    buffer: Buffer,
    x: torch.Tensor,
    handle: DispatchHandle,
    bias: Optional[torch.Tensor] = None,
    config: Optional[Config] = None,
    dispatch_config: Optional[Config] = None,
) -> torch.Tensor:
    """Differentiable ``Buffer.combine`` (unweighted sum back to the source tokens, plus optional ``bias``).

    ``x`` is ``[num_recv_rows, hidden]``, or expert-major ``[handle.expert_major.num_rows, hidden]`` when the handle
    comes from an ``expert_major=True`` dispatch (its backward then returns expert-major gradients).

    Returns ``combined_x [num_tokens, hidden]``; gradients flow to ``x`` and ``bias``.
    """
    return _Combine.apply(buffer, x, handle, bias, config, dispatch_config)
