"""The internode engine: dispatch and combine across nodes.

RDMA leg by NVSHMEM put + signal to the same local index on each node, then NVLink forwarding inside the node; a
staging area and copy-out on the receive side (csrc/kernels/internode.cuh).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from ... import _C, settings
from ...config import Config
from ...handles import DispatchHandle
from ...validation import tokens_per_rank_mismatch
from ..base import CombineArgs, DispatchArgs
from .common import (
    COMBINE_DTYPES,
    EngineContext,
    check_engine_limit,
    engine_dispatch_handle,
    host_read_naming_timeouts,
    kernel_num_sms,
)
from .nvshmem import init_nvshmem, release_nvshmem


@dataclass(frozen=True)
class InternodeState:
    """What an internode dispatch keeps for its cached dispatches and combine (``DispatchHandle.backend_state``).

    count_matrix: ``[num_ranks, num_ranks] int32`` device tensor (tokens rank ``i`` sends to rank ``j``);
    count_matrix_host: the same on the host, ``None`` with ``num_worst_tokens``; node_count: per-node counts of the
    count exchange; send_pos ``[num_tokens, num_ranks]`` / rdma_send_pos ``[num_tokens, num_nodes]`` int32: see
    ``internode_send_positions``; fwd_pos: the forwarding positions the dispatch kernels wrote (the combine's way
    back); tokens_of_host: every rank's token count on the host (``None`` with ``num_worst_tokens``).
    """

    count_matrix: torch.Tensor
    count_matrix_host: Optional[torch.Tensor]
    node_count: torch.Tensor
    send_pos: torch.Tensor
    rdma_send_pos: torch.Tensor
    fwd_pos: torch.Tensor
    tokens_of_host: Optional[torch.Tensor]


def internode_engine_enabled() -> bool:
    """The internode kernels run for a Buffer spanning nodes unless ``EP_DISPATCHER_INTERNODE_ENGINE=0``, which
    selects the reference implementation instead (same results, slower; e.g. to rule the kernels out when
    debugging). They passed the GPU tests on virtual nodes of one GPU (benchmarks/RESULTS.md)."""
    return settings.internode_engine_enabled()


def internode_hidden_bytes(x: torch.Tensor) -> int:
    """Bytes of one row of ``x`` as the internode buffer layout counts them (``hidden * max(element_size, 2)``, as
    ``_C.internode_layout`` and ``InternodeBuffer.max_tokens``)."""
    return x.size(1) * max(x.element_size(), 2)


def internode_send_positions(is_token_in_rank: torch.Tensor, num_ranks_per_node: int):
    """What the internode kernels need from a send pattern, by device ops only (no host sync).

    Args:
        is_token_in_rank: ``[num_tokens, num_ranks] bool``.
    Returns:
        ``(send_pos [num_tokens, num_ranks] int32, rdma_send_pos [num_tokens, num_nodes] int32,
        num_tokens_per_rank [num_ranks] int32, num_tokens_per_node [num_nodes] int32)``: the position of each token
        among this rank's tokens for each destination rank / node, ``-1`` where it is not sent; and the counts.
    """
    num_tokens, num_ranks = is_token_in_rank.shape
    in_rank = is_token_in_rank.contiguous()
    in_rank_int = in_rank.to(torch.int32)
    send_pos = torch.where(in_rank, torch.cumsum(in_rank_int, 0, dtype=torch.int32) - in_rank_int, -1).contiguous()
    in_node = in_rank.view(num_tokens, num_ranks // num_ranks_per_node, num_ranks_per_node).any(2)
    in_node_int = in_node.to(torch.int32)
    rdma_send_pos = torch.where(in_node, torch.cumsum(in_node_int, 0, dtype=torch.int32) - in_node_int, -1).contiguous()
    return send_pos, rdma_send_pos, in_rank_int.sum(0, dtype=torch.int32), in_node_int.sum(0, dtype=torch.int32)


class InternodeEngine:
    """This rank's NVSHMEM internode buffer and the calls that run on it."""

    combine_dtypes = COMBINE_DTYPES

    def __init__(self, ctx: EngineContext, num_rdma_bytes: int):
        check_engine_limit("num_ranks", ctx.num_ranks, _C.INTERNODE_MAX_RANKS, "internode")
        check_engine_limit(
            "num_ranks_per_node", ctx.num_ranks_per_node, _C.INTERNODE_MAX_RANKS_PER_NODE, "internode", "ranks per node"
        )
        self.ctx = ctx
        init_nvshmem(ctx.group, ctx.rank, ctx.num_ranks, num_rdma_bytes)
        self.buffer: "_C.InternodeBuffer" = _C.InternodeBuffer(
            ctx.rank, ctx.num_ranks, ctx.num_ranks_per_node, num_rdma_bytes, ctx.timeout_ns, torch.cuda.current_device()
        )
        self.nvshmem_bytes = num_rdma_bytes
        self._capacity: dict = {}  # hidden_bytes -> tokens per rank the internode buffer holds
        self._pending_counts: Optional[torch.Tensor] = None  # see _counts_check

    def made(self, state: object) -> bool:
        """Whether a handle with this ``backend_state`` came from this engine."""
        return isinstance(state, InternodeState)

    def destroy(self) -> None:
        self.buffer.destroy()
        self.buffer = None
        release_nvshmem(self.nvshmem_bytes)
        self.nvshmem_bytes = 0

    def dispatch(self, args: DispatchArgs):
        """Two-leg dispatch (RDMA to the same local index on each node, then NVLink); see csrc/kernels/internode.cuh.

        The kernels take the per-rank and per-node counts computed here from ``is_token_in_rank`` (device ops, no
        host sync). ``num_tokens_per_rank`` is compared with them on the device; the comparison reaches the host in
        the copy the host already makes of the count matrix, after the data kernels are launched (the peers' kernels
        wait for this rank's rows), and a mismatch raises ``ValueError`` on this rank. With ``num_worst_tokens``
        nothing waits: a mismatch is kept on the device and raised by the next dispatch that waits for the counts.
        """
        x, num_worst_tokens, num_experts = args.x, args.num_worst_tokens, args.num_experts
        num_ranks = self.ctx.num_ranks
        send_pos, rdma_send_pos, per_rank_counts, per_node_counts = internode_send_positions(
            args.is_token_in_rank, self.ctx.num_ranks_per_node
        )
        counts_check = self._counts_check(per_rank_counts, args.num_tokens_per_rank)
        hidden_bytes = internode_hidden_bytes(x)
        if num_worst_tokens > 0:
            self._check_tokens(hidden_bytes, x.size(0), everywhere=False)  # no host sync in this mode
        count_matrix, node_count, tokens_of, per_expert = self.buffer.notify(
            per_rank_counts,
            per_node_counts,
            x.size(0),
            args.num_tokens_per_expert,
            num_experts or 0,
            args.expert_alignment,
        )
        count_matrix_host = tokens_of_host = counts_check_host = None
        per_expert_list: List[int] = []
        if num_worst_tokens == 0:
            # One host sync: the host must know how many rows to allocate, and every rank checks every rank's size.
            host = host_read_naming_timeouts(torch.cat([count_matrix.view(-1), tokens_of, counts_check]))
            count_matrix_host = host[: num_ranks**2].view(num_ranks, num_ranks)
            tokens_of_host = host[num_ranks**2 : num_ranks**2 + num_ranks]
            counts_check_host = host[num_ranks**2 + num_ranks :]
            self._check_tokens(hidden_bytes, int(tokens_of_host.max()), everywhere=True)
            rows_out = int(count_matrix_host[:, self.ctx.rank].sum())
            if per_expert is not None:
                per_expert_list = per_expert.tolist()
        else:
            rows_out = num_worst_tokens
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx, fwd_pos = self.buffer.dispatch(
            x,
            args.x_scales,
            args.topk_idx,
            args.topk_weights,
            (num_experts or num_ranks) // num_ranks,
            send_pos,
            rdma_send_pos,
            count_matrix,
            node_count,
            rows_out,
            hidden_bytes,
            kernel_num_sms(args.config),
            False,
        )
        if counts_check_host is not None:
            self._raise_counts_mismatch(counts_check_host)
        state = InternodeState(
            count_matrix=count_matrix,
            count_matrix_host=count_matrix_host,
            node_count=node_count,
            send_pos=send_pos,
            rdma_send_pos=rdma_send_pos,
            fwd_pos=fwd_pos,
            tokens_of_host=tokens_of_host,
        )
        handle = engine_dispatch_handle(
            args, self.ctx.rank, self.ctx.num_ranks_per_node, count_matrix, recv_src_idx, rows_out, per_expert, state
        )
        return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert_list, handle

    def _counts_check(self, counts: torch.Tensor, num_tokens_per_rank: Optional[torch.Tensor]) -> torch.Tensor:
        """``[2 * num_ranks] int32`` on the device: (the counts ``is_token_in_rank`` gives, ``num_tokens_per_rank``)
        of the first call whose two disagree since the host last looked, else of this call. Device ops only: the
        record lives in one persistent tensor (CUDA-graph safe), read by the next host wait."""
        if num_tokens_per_rank is None:
            num_tokens_per_rank = counts
        if self._pending_counts is None:
            self._pending_counts = torch.zeros(2 * self.ctx.num_ranks, dtype=torch.int32, device=counts.device)
        pending = self._pending_counts
        earlier_bad = (pending[: self.ctx.num_ranks] != pending[self.ctx.num_ranks :]).any()
        pending.copy_(torch.where(earlier_bad, pending, torch.cat([counts, num_tokens_per_rank])))
        return pending

    def _raise_counts_mismatch(self, counts_check_host: torch.Tensor) -> None:
        num_ranks = self.ctx.num_ranks
        error = tokens_per_rank_mismatch(counts_check_host[:num_ranks], counts_check_host[num_ranks:])
        if error is not None:
            self._pending_counts.zero_()  # reported: the next call starts clean
            raise error

    def _check_tokens(self, hidden_bytes: int, num_tokens: int, everywhere: bool) -> None:
        """Raise if ``num_tokens`` tokens per rank of ``hidden_bytes`` do not fit the NVSHMEM buffer.

        ``everywhere``: ``num_tokens`` is the largest count of all ranks (known from the count exchange), so every
        rank raises here together; otherwise only this rank knows, and its peers' kernels will time out.
        """
        capacity = self._capacity.get(hidden_bytes)
        if capacity is None:  # the engine searches layouts token by token: once per row size, not per call
            capacity = self._capacity[hidden_bytes] = self.buffer.max_tokens(hidden_bytes)
        if num_tokens <= capacity:
            return
        need = Config().get_rdma_buffer_size_hint(
            hidden_bytes, self.ctx.num_ranks, self.ctx.num_ranks_per_node, num_max_tokens_per_rank=num_tokens
        )
        who = "some rank of the group passes" if everywhere else "this rank passes"
        raise ValueError(
            f"num_rdma_bytes: {who} {num_tokens} tokens, but the internode buffer holds {capacity} tokens per rank "
            f"of {hidden_bytes} hidden bytes; create the Buffer with num_rdma_bytes >= {need} "
            f"(Config.get_rdma_buffer_size_hint({hidden_bytes}, {self.ctx.num_ranks}, {self.ctx.num_ranks_per_node}, "
            f"num_max_tokens_per_rank={num_tokens}))"
            + ("" if everywhere else "; the other ranks will time out waiting for this one")
        )

    def _check_handle(self, handle: DispatchHandle, hidden_bytes: int) -> None:
        tokens_of = handle.backend_state.tokens_of_host
        if tokens_of is not None:
            self._check_tokens(hidden_bytes, int(tokens_of.max()), everywhere=True)
        else:
            self._check_tokens(hidden_bytes, handle.num_tokens, everywhere=False)

    def cached_dispatch(self, x, x_scales, handle: DispatchHandle, config=None):
        state: InternodeState = handle.backend_state
        num_sms = kernel_num_sms(config)
        hidden_bytes = internode_hidden_bytes(x)
        self._check_handle(handle, hidden_bytes)
        recv_x, recv_scales, _, _, _, _ = self.buffer.dispatch(
            x,
            x_scales,
            None,
            None,
            1,
            state.send_pos,
            state.rdma_send_pos,
            state.count_matrix,
            state.node_count,
            handle.num_recv_rows,
            hidden_bytes,
            num_sms,
            True,
        )
        return recv_x, recv_scales

    def combine(self, args: CombineArgs):
        x, handle, topk_weights, bias = args.x, args.handle, args.topk_weights, args.bias
        state: InternodeState = handle.backend_state
        num_sms = kernel_num_sms(args.config)
        bias0 = bias[0].contiguous() if len(bias) > 0 else None
        bias1 = bias[1].contiguous() if len(bias) > 1 else None
        self._check_handle(handle, internode_hidden_bytes(x))
        return self.buffer.combine(
            x.contiguous(),
            None if topk_weights is None else topk_weights.contiguous(),
            bias0,
            bias1,
            state.rdma_send_pos,
            state.count_matrix,
            state.node_count,
            state.fwd_pos,
            handle.num_tokens,
            internode_hidden_bytes(x),
            num_sms,
        )
