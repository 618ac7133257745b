"""Routing bookkeeping for the Megatron plugin (pure PyTorch, no Megatron import).

Three steps turn Megatron's router output into what ``ep_dispatcher`` moves and what grouped experts consume:

1. ``routing_to_topk``: Megatron's multi-hot ``routing_map [N, E] bool`` and dense ``probs [N, E]`` become
   ``topk_idx [N, k] int64`` (``-1`` = no expert, e.g. a token dropped by the capacity factor) and
   ``topk_weights [N, k] float32`` (differentiable w.r.t. ``probs``).
2. ``fold_tensor_parallel``: with expert tensor parallelism (TP > 1) every TP rank of an expert's EP rank needs the
   token, so each selected expert becomes ``tp`` entries in a ``tp * E`` expert space laid out rank-major over the
   ``TP x EP`` group (rank ``ep_rank * tp + tp_rank`` holds the local experts of ``ep_rank``), as Megatron's flex
   dispatcher lays it out. The weights are repeated: each TP rank applies them to its partial expert output, and
   combine sums the partials.
3. ``expert_major_order``: on the receiving rank, the ``(token, slot)`` pairs that select a local expert, ordered
   by local expert, then by received-token order (source rank ascending, source order kept). That is the order
   Megatron's ``allgather`` dispatcher gives each expert's tokens, so expert inputs match it row for row.
"""

from __future__ import annotations

import torch


def routing_to_topk(routing_map: torch.Tensor, probs: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids and fp32 weights from Megatron's routing map and probabilities.

    Args:
        routing_map: ``[num_tokens, num_experts] bool``, at most ``topk`` True entries per row.
        probs: ``[num_tokens, num_experts]`` floating point, the gate weights (zero where ``routing_map`` is False).
        topk: slots per token.
    Returns:
        ``(topk_idx [num_tokens, topk] int64, topk_weights [num_tokens, topk] float32)``. A row with fewer than
        ``topk`` selected experts has ``-1`` ids (weight 0) in its spare slots. Weights are gathered from ``probs``,
        so gradients flow back to it.
    """
    if routing_map.shape != probs.shape:
        raise ValueError(f"routing_map: expected the shape of probs {list(probs.shape)}, got {list(routing_map.shape)}")
    if routing_map.dtype != torch.bool:
        routing_map = routing_map.bool()
    if not 1 <= topk <= routing_map.size(1):
        raise ValueError(f"topk: expected 1 <= topk <= num_experts={routing_map.size(1)}, got {topk}")
    # Selection comes from the map (a selected expert with probability 0 still gets the token, as with the
    # allgather dispatcher); unselected experts sort last and are turned into -1 below.
    with torch.no_grad():
        score = torch.where(routing_map, probs.detach().float(), torch.full_like(probs, -1.0, dtype=torch.float32))
        _, topk_idx = torch.topk(score, topk, dim=1)
        selected = routing_map.gather(1, topk_idx)
        topk_idx = topk_idx.masked_fill(~selected, -1)
    topk_weights = probs.gather(1, topk_idx.clamp(min=0)).float() * selected
    return topk_idx, topk_weights


def fold_tensor_parallel(
    topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_local_experts: int, tp_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expand ids over the ``TP x EP`` group: expert ``g`` of EP rank ``g // L`` becomes the ``tp_size`` experts
    ``(g // L * tp_size + t) * L + g % L`` (``t`` = TP rank, ``L`` = ``num_local_experts``).

    Returns ``([num_tokens, topk * tp_size] int64, [num_tokens, topk * tp_size] float32)``; ``-1`` stays ``-1``.
    """
    if tp_size == 1:
        return topk_idx, topk_weights
    num_tokens, topk = topk_idx.shape
    tp_offsets = torch.arange(tp_size, device=topk_idx.device, dtype=topk_idx.dtype)
    ep_rank, local = topk_idx.div(num_local_experts, rounding_mode="floor"), topk_idx.remainder(num_local_experts)
    folded = (ep_rank.unsqueeze(-1) * tp_size + tp_offsets) * num_local_experts + local.unsqueeze(-1)
    folded = torch.where(topk_idx.unsqueeze(-1) >= 0, folded, torch.full_like(folded, -1))
    weights = topk_weights.unsqueeze(-1).expand(num_tokens, topk, tp_size)
    return folded.reshape(num_tokens, topk * tp_size), weights.reshape(num_tokens, topk * tp_size)


def expert_major_order(recv_topk_idx: torch.Tensor, num_local_experts: int, num_out_rows: int) -> torch.Tensor:
    """Positions in ``recv_topk_idx.flatten()`` of the pairs that pick a local expert, expert-major.

    Args:
        recv_topk_idx: ``[num_recv_tokens, num_topk] int64`` local expert ids, ``-1`` = expert elsewhere.
        num_local_experts: experts on this rank.
        num_out_rows: how many pairs pick a local expert (the sum of the dispatch's per-expert count list, known on
            the host, so nothing here waits for the device).
    Returns:
        ``[num_out_rows] int64``; entry ``i`` is ``row * num_topk + slot``. Row ``row`` of ``recv_x`` is the ``i``-th
        expert input. A stable sort keeps received-token order inside each expert (a token picks an expert at most
        once, so its slots never tie).
    """
    flat = recv_topk_idx.reshape(-1)
    key = torch.where(flat >= 0, flat, torch.full_like(flat, num_local_experts))
    _, order = torch.sort(key, stable=True)
    return order[:num_out_rows]
