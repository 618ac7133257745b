"""Handles: what a dispatch hands to the matching combine (and to cached dispatches).

A handle belongs to the ``Buffer`` that made it (``buffer_id``); passing it to another buffer is an error.
Fields named here are the observable contract shared by every backend; ``backend_state`` holds whatever
extra a backend keeps (ring-buffer prefix matrices, send orders) and is opaque to callers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class DispatchHandle:
    """Layout of one high-throughput dispatch.

    rank_prefix_matrix: ``[num_ranks, num_ranks] int32``; entry ``[i, j]`` = tokens ranks ``0..i`` send to rank ``j``.
        Column ``rank`` gives where each source rank's tokens start in ``recv_x``.
    recv_src_idx: ``[num_recv_tokens] int32``, index of each received token on its source rank.
    is_token_in_rank: ``[num_tokens, num_ranks] bool``, this rank's send pattern.
    num_recv_tokens: rows of ``recv_x`` that hold tokens; ``-1`` with ``num_worst_tokens`` (knowing it would need a
        host sync: read ``rank_prefix_matrix[-1, rank]`` on the device instead). Rows past it are padding:
        ``recv_topk_idx == -1``, weight 0, ``recv_src_idx == -1``, ``recv_x`` unspecified.
    num_recv_tokens_per_expert: ``[num_local_experts] int32`` device tensor, counts rounded up to
        ``expert_alignment`` (``None`` when dispatched without ``topk_idx``); read it instead of the host list
        to avoid a host sync.
    """

    buffer_id: int
    num_ranks: int
    rank_prefix_matrix: torch.Tensor
    recv_src_idx: torch.Tensor
    is_token_in_rank: torch.Tensor
    num_recv_tokens: int
    num_recv_tokens_per_expert: Optional[torch.Tensor]
    num_worst_tokens: int = 0
    expert_alignment: int = 1
    backend_state: Any = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.is_token_in_rank.size(0)

    @property
    def num_recv_rows(self) -> int:
        """Rows of ``recv_x`` (and of combine's input): ``num_worst_tokens`` when set, else ``num_recv_tokens``."""
        return self.num_worst_tokens if self.num_worst_tokens > 0 else self.num_recv_tokens


@dataclass
class LowLatencyHandle:
    """Layout of one low-latency dispatch (expert-major, ``num_ranks * num_max_dispatch_tokens_per_rank`` slots
    per local expert).

    src_info: ``[num_local_experts, num_ranks * max_tokens] int32``, source token index of each filled slot
        (``-1`` in unfilled slots).
    layout_range: ``[num_local_experts, num_ranks] int64``; ``(begin << 32) | count`` of the slots of each
        (local expert, source rank) pair; ranges are in source-rank order.
    """

    buffer_id: int
    src_info: torch.Tensor
    layout_range: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    num_tokens: int
    num_topk: int
    backend_state: Any = field(default=None, repr=False)
    received: bool = True  # False until the receive phase (the hook) of the dispatch that made it has run
