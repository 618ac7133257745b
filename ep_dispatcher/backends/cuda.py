"""CUDA backend: the ``ep_dispatcher._C`` engine.

Intranode dispatch/combine run as kernels over CUDA-IPC buffers (csrc/kernels/intranode.cuh explains the design:
every token is written once, straight into the receiver's output tensors, which own regions of its receive pool).
Internode dispatch/combine run over NVSHMEM with NVLink forwarding (csrc/kernels/internode.cuh), low-latency
dispatch/combine over an NVSHMEM symmetric buffer (csrc/kernels/low_latency.cuh). What the engine does not cover
(fp16/fp64 combine, CPU tensors) is served by the reference implementation on the same tensors, so a ``Buffer``
always works; ``engine_calls()`` says which calls are kernels.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import socket

import torch
import torch.distributed as dist

from .. import _C, settings
from ..config import Config
from ..handles import DispatchHandle, LowLatencyHandle
from .reference import ReferenceBackend

_COMBINE_DTYPES = (torch.bfloat16, torch.float32)  # dtypes the combine kernel sums


class CudaBackend(ReferenceBackend):
    name = "cuda"

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        num_ranks: int,
        num_ranks_per_node: int,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        allow_nvlink: bool = True,
        timeout_s: float = 100.0,
        **engine_options,
    ):
        super().__init__(group, rank, num_ranks, num_ranks_per_node)
        self.timeout_ns = int(timeout_s * 1e9)
        self.ipc: Optional["_C.IpcBuffer"] = None
        if num_nvl_bytes > 0 and num_ranks <= num_ranks_per_node:
            if num_ranks > _C.INTRANODE_MAX_RANKS:
                raise ValueError(
                    f"num_ranks: the intranode engine supports up to {_C.INTRANODE_MAX_RANKS} ranks, got {num_ranks}"
                )
            self.ipc = self._open_ipc(num_nvl_bytes)
        self.ll: Optional["_C.LowLatencyBuffer"] = None
        self.internode: Optional["_C.InternodeBuffer"] = None
        self._internode_capacity: dict = {}  # hidden_bytes -> tokens per rank the internode buffer holds
        self._ll_combine_views: dict = {}  # (half, shape) -> the zero-copy combine buffer (a view of the half)
        self._nvshmem_bytes = 0
        if num_rdma_bytes > 0 and _C.has_nvshmem() and low_latency_mode:
            _init_nvshmem(group, rank, num_ranks, num_rdma_bytes)
            device = torch.cuda.current_device()
            self.ll = _C.LowLatencyBuffer(
                rank, num_ranks, num_rdma_bytes, allow_nvlink, self.timeout_ns, device, _low_latency_max_blocks(group)
            )
            self._nvshmem_bytes = num_rdma_bytes
        elif num_rdma_bytes > 0 and _C.has_nvshmem() and num_ranks > num_ranks_per_node and internode_engine_enabled():
            if num_ranks > _C.INTERNODE_MAX_RANKS:
                raise ValueError(
                    f"num_ranks: the internode engine supports up to {_C.INTERNODE_MAX_RANKS} ranks, got {num_ranks}"
                )
            if num_ranks_per_node > _C.INTERNODE_MAX_RANKS_PER_NODE:
                raise ValueError(
                    f"num_ranks_per_node: the internode engine supports up to {_C.INTERNODE_MAX_RANKS_PER_NODE} ranks "
                    f"per node, got {num_ranks_per_node}"
                )
            _init_nvshmem(group, rank, num_ranks, num_rdma_bytes)
            self.internode = _C.InternodeBuffer(
                rank, num_ranks, num_ranks_per_node, num_rdma_bytes, self.timeout_ns, torch.cuda.current_device()
            )
            self._nvshmem_bytes = num_rdma_bytes

    def _open_ipc(self, num_bytes: int) -> "_C.IpcBuffer":
        """This rank's CUDA-IPC buffer (signal area + receive pool of ``num_bytes``), with every peer's mapped
        (collective)."""
        ipc = _C.IpcBuffer(self.rank, self.num_ranks, num_bytes, torch.cuda.current_device())
        handles: List[bytes] = [b""] * self.num_ranks
        dist.all_gather_object(handles, ipc.ipc_handle(), group=self.group)
        ipc.open_peers(handles)
        dist.barrier(group=self.group)  # every rank has mapped every buffer before anyone writes
        return ipc

    def _grow_receive_pool(self, needed_bytes: int) -> None:
        """Replace the receive pool by one of twice ``needed_bytes`` (room for one call's outputs and the next call).

        Collective, and every rank calls it at the same point: the need comes from the count matrix, which all ranks
        share. Outputs still alive in the old pool move out of it (copied, their storage re-pointed) before it goes.
        """
        old = self.ipc
        self.ipc = self._open_ipc(max(2 * int(needed_bytes), old.data_bytes))
        old.destroy()

    @staticmethod
    def _num_sms(config: Optional[Config]) -> int:
        """SMs of a data kernel: the call's config (Buffer passes one built from ``Buffer.num_sms`` by default)."""
        return (config or Config()).num_sms

    def engine_calls(self) -> tuple:
        calls = ("get_dispatch_layout",)
        if self.ipc is not None:
            calls += ("dispatch", "cached_dispatch", "combine")
        if self.internode is not None:
            calls += ("dispatch", "cached_dispatch", "combine")
        if self.ll is not None:
            calls += ("low_latency_dispatch", "low_latency_combine")
        return calls

    def destroy(self) -> None:
        if self.ipc is not None:
            self.ipc.destroy()
            self.ipc = None
        if self.ll is not None:
            self._ll_combine_views.clear()
            self.ll.destroy()
            self.ll = None
        if self.internode is not None:
            self.internode.destroy()
            self.internode = None
        _release_nvshmem(self._nvshmem_bytes)
        self._nvshmem_bytes = 0

    def checks_topk_idx_on_device(self, call: str, topk_idx: torch.Tensor) -> bool:
        """The layout kernel ignores ids outside ``[0, num_experts)``, the intranode dispatch reports them (every
        rank raises ``ValueError`` after the count exchange), and the low-latency kernels skip bad ids and experts
        listed twice by a token and report them through ``take_low_latency_error``: none needs a host sync."""
        if not topk_idx.is_cuda:
            return False
        if call == "low_latency":
            return self.ll is not None
        return call == "get_dispatch_layout" or (call == "dispatch" and self.ipc is not None)

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        if not topk_idx.is_cuda:
            return super().get_dispatch_layout(topk_idx, num_experts)
        return tuple(_C.get_dispatch_layout(topk_idx, num_experts, self.num_ranks, self.num_ranks_per_node))

    # ------------------------------------------------------------------ intranode dispatch / combine
    def _uses_engine(self, x: torch.Tensor) -> bool:
        return self.ipc is not None and x.is_cuda

    def dispatch(
        self,
        x,
        x_scales,
        is_token_in_rank,
        num_tokens_per_rank,
        topk_idx,
        topk_weights,
        num_experts,
        expert_alignment,
        num_worst_tokens,
        buffer_id,
        config=None,
        num_tokens_per_expert=None,
    ):
        if self.internode is not None and x.is_cuda:
            return self._internode_dispatch(
                x, x_scales, is_token_in_rank, topk_idx, topk_weights, num_experts, expert_alignment,
                num_worst_tokens, buffer_id, config, num_tokens_per_expert,
            )
        if not self._uses_engine(x):
            return super().dispatch(
                x,
                x_scales,
                is_token_in_rank,
                num_tokens_per_rank,
                topk_idx,
                topk_weights,
                num_experts,
                expert_alignment,
                num_worst_tokens,
                buffer_id,
                num_tokens_per_expert=num_tokens_per_expert,
            )
        # One C++ entry: send positions and content checks on the device, the count exchange, the host's wait for the
        # counts (host-mapped memory, no stream sync; none with num_worst_tokens), the data kernels.
        # A call whose rows do not fit in some rank's empty pool returns the size it needs, on every rank alike
        # (same counts): the pools grow together and the call runs again (once: the grown pool holds it).
        def run():
            return _C.intranode_dispatch_fresh(
                self.ipc, x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_rank,
                num_tokens_per_expert, num_experts or 0, expert_alignment, num_worst_tokens, self._num_sms(config),
                self.timeout_ns,
            )

        outputs = run()
        if outputs[-1] > 0:
            self._grow_receive_pool(outputs[-1])
            outputs = run()
        if outputs[-1] > 0:  # never expected: the outputs of a call that did not run must not be returned
            raise RuntimeError(f"intranode dispatch: {outputs[-1]} receive-pool bytes needed after growing the pool")
        (
            recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx,
            send_pos, count_matrix, rank_prefix_matrix, per_expert, count_matrix_host, per_expert_list, rows_out,
            sent_rows, most_sent, _,
        ) = outputs
        handle = self._engine_handle(
            buffer_id, count_matrix, recv_src_idx, is_token_in_rank, rows_out, per_expert, num_worst_tokens,
            expert_alignment, rank_prefix_matrix=rank_prefix_matrix, count_matrix_host=count_matrix_host,
            send_pos=send_pos, sent_rows=sent_rows, most_sent=most_sent,
        )
        return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert_list, handle

    def _engine_handle(
        self, buffer_id, count_matrix, recv_src_idx, is_token_in_rank, rows_out, per_expert, num_worst_tokens,
        expert_alignment, rank_prefix_matrix=None, **state,
    ) -> DispatchHandle:
        """The handle of a dispatch the engine ran; ``state`` is what its cached dispatch and combine reuse."""
        if rank_prefix_matrix is None:
            rank_prefix_matrix = torch.cumsum(count_matrix, dim=0, dtype=torch.int32)
        return DispatchHandle(
            buffer_id=buffer_id,
            num_ranks=self.num_ranks,
            rank_prefix_matrix=rank_prefix_matrix,
            recv_src_idx=recv_src_idx,
            is_token_in_rank=is_token_in_rank,
            num_recv_tokens=rows_out if num_worst_tokens == 0 else -1,
            num_recv_tokens_per_expert=per_expert,
            num_worst_tokens=num_worst_tokens,
            expert_alignment=expert_alignment,
            backend_state={"engine": "cuda", "count_matrix": count_matrix, **state},
        )

    def cached_dispatch(self, x, x_scales, handle: DispatchHandle, config=None):
        state = handle.backend_state
        if state.get("internode") and x.is_cuda:
            return self._internode_cached_dispatch(x, x_scales, handle, config)
        if not (self._uses_engine(x) and state.get("engine") == "cuda"):
            return super().cached_dispatch(x, x_scales, self._reference_view(handle))
        num_sms = self._num_sms(config)
        recv_x, recv_scales, _, _, _ = _C.intranode_dispatch(
            self.ipc,
            x,
            x_scales,
            None,
            None,
            1,
            handle.is_token_in_rank,
            state["send_pos"],
            state["count_matrix"],
            handle.num_recv_rows,
            num_sms,
            self.timeout_ns,
            False,  # cached: x and scales only
        )
        return recv_x, recv_scales

    def combine(self, x, handle: DispatchHandle, topk_weights, bias: Sequence[torch.Tensor], config=None):
        state = handle.backend_state
        if state.get("internode") and x.is_cuda and x.dtype in _COMBINE_DTYPES:
            return self._internode_combine(x, handle, topk_weights, bias, config)
        if not (self._uses_engine(x) and state.get("engine") == "cuda" and x.dtype in _COMBINE_DTYPES):
            return super().combine(x, self._reference_view(handle), topk_weights, bias)
        num_sms = self._num_sms(config)
        # Every rank checks the most rows any rank gets back (all know the count matrix), so all grow together.
        num_topk = 0 if topk_weights is None else topk_weights.size(1)
        row_bytes = x.size(1) * x.element_size()
        # With num_worst_tokens the host has no counts (most_sent is then a bound of this rank's alone): no growth.
        known = state["count_matrix_host"] is not None
        if known and state["most_sent"] > self.ipc.combine_capacity(row_bytes, num_topk):
            self._grow_receive_pool(_C.intranode_combine_bytes(state["most_sent"], row_bytes, num_topk))
        bias0 = bias[0] if len(bias) > 0 else None
        bias1 = bias[1] if len(bias) > 1 else None
        return _C.intranode_combine(
            self.ipc,
            x,
            topk_weights,
            bias0,
            bias1,
            handle.is_token_in_rank,
            state["send_pos"],
            state["count_matrix"],
            handle.num_tokens,
            state["sent_rows"],
            num_sms,
            self.timeout_ns,
        )

    def _reference_view(self, handle: DispatchHandle) -> DispatchHandle:
        """A handle made by the engine, with the fields the reference implementation needs (one host sync)."""
        state = handle.backend_state
        if state.get("engine") != "cuda" or "send_idx" in state:
            return handle
        matrix = state["count_matrix_host"]
        if matrix is None:
            matrix = state["count_matrix"].cpu()
        _, token = torch.nonzero(handle.is_token_in_rank.t(), as_tuple=True)
        state.update(
            send_idx=token,
            send_counts=matrix[self.rank].tolist(),
            recv_counts=matrix[:, self.rank].tolist(),
            num_recv=int(matrix[:, self.rank].sum()),
        )
        return handle


    # ------------------------------------------------------------------ internode dispatch / combine
    def _internode_dispatch(
        self, x, x_scales, is_token_in_rank, topk_idx, topk_weights, num_experts, expert_alignment, num_worst_tokens,
        buffer_id, config, num_tokens_per_expert,
    ):
        """Two-leg dispatch (RDMA to the same local index on each node, then NVLink); see csrc/kernels/internode.cuh.

        The per-rank and per-node counts are recomputed here from ``is_token_in_rank`` (device ops, no host sync), so
        the kernels cannot be handed counts that disagree with the routing.
        """
        num_sms = self._num_sms(config)
        send_pos, rdma_send_pos, per_rank_counts, per_node_counts = internode_send_positions(
            is_token_in_rank, self.num_ranks_per_node
        )
        hidden_bytes = x.size(1) * max(x.element_size(), 2)
        if num_worst_tokens > 0:
            self._internode_check_tokens(hidden_bytes, x.size(0), everywhere=False)  # no host sync in this mode
        count_matrix, node_count, tokens_of, per_expert = self.internode.notify(
            per_rank_counts, per_node_counts, x.size(0), num_tokens_per_expert, num_experts or 0, expert_alignment
        )
        count_matrix_host = tokens_of_host = None
        per_expert_list: List[int] = []
        if num_worst_tokens == 0:
            # One host sync: the host must know how many rows to allocate, and every rank checks every rank's size.
            host = torch.cat([count_matrix.view(-1), tokens_of]).cpu()
            count_matrix_host = host[: self.num_ranks**2].view(self.num_ranks, self.num_ranks)
            tokens_of_host = host[self.num_ranks**2 :]
            self._internode_check_tokens(hidden_bytes, int(tokens_of_host.max()), everywhere=True)
            rows_out = int(count_matrix_host[:, self.rank].sum())
            if per_expert is not None:
                per_expert_list = per_expert.tolist()
        else:
            rows_out = num_worst_tokens
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx, fwd_pos = self.internode.dispatch(
            x, x_scales, topk_idx, topk_weights, (num_experts or self.num_ranks) // self.num_ranks, send_pos,
            rdma_send_pos, count_matrix, node_count, rows_out, hidden_bytes, num_sms, False,
        )
        handle = self._engine_handle(
            buffer_id, count_matrix, recv_src_idx, is_token_in_rank, rows_out, per_expert, num_worst_tokens,
            expert_alignment, internode=True, count_matrix_host=count_matrix_host, node_count=node_count,
            send_pos=send_pos, rdma_send_pos=rdma_send_pos, fwd_pos=fwd_pos, tokens_of_host=tokens_of_host,
        )
        return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert_list, handle

    def _internode_check_tokens(self, hidden_bytes: int, num_tokens: int, everywhere: bool) -> None:
        """Raise if ``num_tokens`` tokens per rank of ``hidden_bytes`` do not fit the NVSHMEM buffer.

        ``everywhere``: ``num_tokens`` is the largest count of all ranks (known from the count exchange), so every
        rank raises here together; otherwise only this rank knows, and its peers' kernels will time out.
        """
        capacity = self._internode_capacity.get(hidden_bytes)
        if capacity is None:  # the engine searches layouts token by token: once per row size, not per call
            capacity = self._internode_capacity[hidden_bytes] = self.internode.max_tokens(hidden_bytes)
        if num_tokens <= capacity:
            return
        need = Config().get_rdma_buffer_size_hint(
            hidden_bytes, self.num_ranks, self.num_ranks_per_node, num_max_tokens_per_rank=num_tokens
        )
        who = "some rank of the group passes" if everywhere else "this rank passes"
        raise ValueError(
            f"num_rdma_bytes: {who} {num_tokens} tokens, but the internode buffer holds {capacity} tokens per rank "
            f"of {hidden_bytes} hidden bytes; create the Buffer with num_rdma_bytes >= {need} "
            f"(Config.get_rdma_buffer_size_hint({hidden_bytes}, {self.num_ranks}, {self.num_ranks_per_node}, "
            f"num_max_tokens_per_rank={num_tokens}))"
            + ("" if everywhere else "; the other ranks will time out waiting for this one")
        )

    def _internode_check_handle(self, handle: DispatchHandle, hidden_bytes: int) -> None:
        tokens_of = handle.backend_state["tokens_of_host"]
        if tokens_of is not None:
            self._internode_check_tokens(hidden_bytes, int(tokens_of.max()), everywhere=True)
        else:
            self._internode_check_tokens(hidden_bytes, handle.num_tokens, everywhere=False)

    def _internode_cached_dispatch(self, x, x_scales, handle: DispatchHandle, config):
        state = handle.backend_state
        num_sms = self._num_sms(config)
        hidden_bytes = x.size(1) * max(x.element_size(), 2)
        self._internode_check_handle(handle, hidden_bytes)
        recv_x, recv_scales, _, _, _, _ = self.internode.dispatch(
            x, x_scales, None, None, 1, state["send_pos"], state["rdma_send_pos"], state["count_matrix"],
            state["node_count"], handle.num_recv_rows, hidden_bytes, num_sms, True,
        )
        return recv_x, recv_scales

    def _internode_combine(self, x, handle: DispatchHandle, topk_weights, bias: Sequence[torch.Tensor], config):
        state = handle.backend_state
        num_sms = self._num_sms(config)
        bias0 = bias[0].contiguous() if len(bias) > 0 else None
        bias1 = bias[1].contiguous() if len(bias) > 1 else None
        self._internode_check_handle(handle, x.size(1) * max(x.element_size(), 2))
        return self.internode.combine(
            x.contiguous(), None if topk_weights is None else topk_weights.contiguous(), bias0, bias1,
            state["rdma_send_pos"], state["count_matrix"], state["node_count"], state["fwd_pos"], handle.num_tokens,
            x.size(1) * max(x.element_size(), 2), num_sms,
        )

    # ------------------------------------------------------------------ low-latency dispatch / combine
    def take_low_latency_error(self) -> Optional[tuple]:
        """``(code, token, k, value)`` of the last bad ``topk_idx`` entry the kernels that have run reported (then
        cleared), or None; codes in ``validation.low_latency_topk_error``."""
        return None if self.ll is None else self.ll.take_error()

    def low_latency_dispatch(
        self,
        x,
        topk_idx,
        num_max_dispatch_tokens_per_rank,
        num_experts,
        use_fp8,
        round_scale,
        use_ue8m0,
        buffer_id,
        half=0,
        cumulative_stats=None,
        wait_stats=None,
    ):
        if self.ll is None or not x.is_cuda:
            return super().low_latency_dispatch(
                x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0, buffer_id,
                half=half, cumulative_stats=cumulative_stats, wait_stats=wait_stats,
            )
        num_tokens, hidden = x.shape
        max_tokens = num_max_dispatch_tokens_per_rank
        # One C++ entry launches the send phase and allocates the handle's tensors. send_slot is the plan: each
        # (token, k) entry's slot at its expert (what the combine reads), then per-expert counts.
        send_slot, src_info, layout_range = self.ll.dispatch_send(
            half, x, topk_idx, max_tokens, num_experts, use_fp8, round_scale
        )
        handle = LowLatencyHandle(
            buffer_id=buffer_id,
            src_info=src_info,
            layout_range=layout_range,
            num_max_dispatch_tokens_per_rank=max_tokens,
            hidden=hidden,
            num_experts=num_experts,
            num_tokens=num_tokens,
            num_topk=topk_idx.size(1),
            backend_state={"engine": "cuda", "send_slot": send_slot},
        )

        def receive(recv_x: torch.Tensor, recv_scales: Optional[torch.Tensor], recv_count: torch.Tensor) -> None:
            # The scales are a transposed view of a [E_local, groups, slots] tensor: the kernel writes that storage.
            # wait_stats: the receive kernel adds the clock64 cycles it spun per source rank (no extra kernel).
            storage = None if recv_scales is None else recv_scales.transpose(1, 2)
            self.ll.dispatch_recv(
                half, max_tokens, num_experts, hidden, use_fp8, use_ue8m0, recv_x, storage, src_info, layout_range,
                recv_count, cumulative_stats, wait_stats,
            )

        return handle, receive

    def low_latency_combine(self, x, topk_idx, topk_weights, handle: LowLatencyHandle, half: int = 0, wait_stats=None):
        state = handle.backend_state
        if self.ll is None or not x.is_cuda or state.get("engine") != "cuda":
            return super().low_latency_combine(x, topk_idx, topk_weights, handle, half=half, wait_stats=wait_stats)
        max_tokens, num_experts = handle.num_max_dispatch_tokens_per_rank, handle.num_experts
        self.ll.combine_send(half, x, handle.layout_range, max_tokens, num_experts)

        def receive(out: torch.Tensor) -> None:
            self.ll.combine_recv(
                half, topk_idx, topk_weights, state["send_slot"], max_tokens, num_experts, out, self.ll.max_blocks,
                wait_stats,
            )

        return receive

    def logfmt_roundtrip(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """LogFMT-10 round trip by the kernel (csrc/kernels/logfmt.cu, bit-exact with the reference). Buffer runs it
        as an extra pass before the combine kernel (use_logfmt=True); fusing the encode into combine_send would save
        that pass and shrink the messages to 10 bits per channel."""
        if not x.is_cuda or not x.is_contiguous():
            return super().logfmt_roundtrip(x, inplace)
        return _C.logfmt_roundtrip(x, inplace)

    def low_latency_combine_buffer(self, half: int, shape, device: torch.device) -> torch.Tensor:
        if self.ll is None or device.type != "cuda":
            return super().low_latency_combine_buffer(half, shape, device)
        key = (half, tuple(shape))
        view = self._ll_combine_views.get(key)
        if view is None:  # a view of the half's send area: made once, asked for on every zero-copy combine
            num_local_experts, num_slots, hidden = shape
            max_tokens = num_slots // self.num_ranks
            view = self.ll.combine_buffer(half, max_tokens, num_local_experts * self.num_ranks, hidden)
            self._ll_combine_views[key] = view
        return view

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        if self.ll is not None:
            # NVSHMEM's host barrier inside clean() has no timeout: meet in the process group first (it has one), so
            # a rank that died or diverged turns into an error here instead of a hang.
            torch.cuda.synchronize()
            dist.barrier(group=self.group)
            self.ll.clean()


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


_NVSHMEM_HEAP_SLACK = 256 << 20  # NVSHMEM keeps its own state in the symmetric heap too


def internode_engine_enabled() -> bool:
    """The internode kernels run for a Buffer spanning nodes unless ``EP_DISPATCHER_INTERNODE_ENGINE=0``, which
    selects the reference implementation instead (same results, slower; e.g. to rule the kernels out when
    debugging). They passed the GPU tests on virtual nodes of one GPU (benchmarks/RESULTS.md)."""
    return settings.internode_engine_enabled()


def ranks_sharing_this_gpu(group: dist.ProcessGroup) -> int:
    """How many ranks of ``group`` (this one included) run on this process's GPU (collective)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    me = (socket.gethostname(), str(getattr(props, "uuid", "")) or str(getattr(props, "pci_bus_id", "")))
    everyone: List[Optional[tuple]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, me, group=group)
    return sum(1 for other in everyone if other == me)


def _low_latency_max_blocks(group: dist.ProcessGroup) -> int:
    """Grid bound of the low-latency kernels: they spin on peers' signals, so every rank's blocks on one GPU must be
    resident together (one 512-thread block per SM always fits): SMs / ranks on the GPU. Env override:
    ``EP_DISPATCHER_LL_MAX_BLOCKS``."""
    sharing = ranks_sharing_this_gpu(group)  # collective: computed even when the env var is set
    if settings.low_latency_max_blocks() is not None:
        return settings.low_latency_max_blocks()
    sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return max(1, sm_count // sharing)


_nvshmem_reserved = 0  # symmetric bytes held by this process's live buffers (low-latency and internode)


def _release_nvshmem(num_bytes: int) -> None:
    global _nvshmem_reserved
    _nvshmem_reserved = max(0, _nvshmem_reserved - num_bytes)


def _init_nvshmem(group: dist.ProcessGroup, rank: int, num_ranks: int, num_rdma_bytes: int) -> None:
    """Initialise NVSHMEM over ``group`` (once per process): rank 0's unique id travels through the process group.

    The symmetric heap is sized once, at initialisation, from NVSHMEM_SYMMETRIC_SIZE; when unset it is set to this
    buffer plus slack. A process that holds both an internode and a low-latency buffer must set it to at least the
    sum of their num_rdma_bytes plus 256 MiB before creating the first one; otherwise the second raises here.
    """
    global _nvshmem_reserved
    if _C.nvshmem_is_initialized():
        heap = settings.nvshmem_symmetric_size()
        # Certain not to fit (NVSHMEM's own state needs room too, so nvshmem_malloc may still fail short of this).
        if heap is not None and _nvshmem_reserved + num_rdma_bytes > heap:
            raise ValueError(
                f"num_rdma_bytes: this process already holds {_nvshmem_reserved} bytes of NVSHMEM buffers and the "
                f"symmetric heap is NVSHMEM_SYMMETRIC_SIZE={heap} bytes; a further {num_rdma_bytes} bytes do not fit. "
                f"Set NVSHMEM_SYMMETRIC_SIZE >= {_nvshmem_reserved + num_rdma_bytes + _NVSHMEM_HEAP_SLACK} before the "
                "first Buffer is created (the heap is sized once per process)"
            )
        _C.nvshmem_init(b"", rank, num_ranks)  # only checks that the world is the same
        _nvshmem_reserved += num_rdma_bytes
        return
    # NVSHMEM sizes its symmetric heap from the environment at init; make room for this buffer unless the user chose.
    settings.default_nvshmem_symmetric_size(num_rdma_bytes + _NVSHMEM_HEAP_SLACK)
    _nvshmem_reserved += num_rdma_bytes
    unique_id = [_C.nvshmem_get_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(unique_id, src=dist.get_global_rank(group, 0), group=group)
    _C.nvshmem_init(unique_id[0], rank, num_ranks)


def has_nvshmem() -> bool:
    """Whether the engine was built with NVSHMEM (internode and low-latency kernels need it)."""
    return bool(_C.has_nvshmem())
