"""CUDA backend: the ``ep_dispatcher._C`` engine.

Intranode dispatch/combine run as kernels over CUDA-IPC buffers (csrc/kernels/intranode.cuh explains the
design: every token is written once, straight to its final row in the receiver's buffer). Calls the engine does
not cover yet (internode, low latency, fp16/fp64 combine, CPU tensors) are served by the reference
implementation on the same tensors, so a ``Buffer`` always works; ``engine_calls()`` says which calls are kernels.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import _C
from ..config import Config
from ..handles import DispatchHandle
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
            device = torch.cuda.current_device()
            self.ipc = _C.IpcBuffer(rank, num_ranks, num_nvl_bytes, device)
            handles: List[bytes] = [b""] * num_ranks
            dist.all_gather_object(handles, self.ipc.ipc_handle(), group=group)
            self.ipc.open_peers(handles)
            dist.barrier(group=group)  # every rank has mapped every buffer before anyone writes

    def engine_calls(self) -> tuple:
        calls = ("get_dispatch_layout",)
        if self.ipc is not None:
            calls += ("dispatch", "cached_dispatch", "combine")
        return calls

    def destroy(self) -> None:
        if self.ipc is not None:
            self.ipc.destroy()
            self.ipc = None

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
            )
        num_sms = (config or Config()).num_sms
        # Position of each token among this rank's tokens for each destination (source order kept).
        in_rank_int = is_token_in_rank.to(torch.int32)
        send_pos = (torch.cumsum(in_rank_int, dim=0, dtype=torch.int32) - in_rank_int).contiguous()
        count_matrix, per_expert = _C.intranode_notify(
            self.ipc, num_tokens_per_rank, num_tokens_per_expert, num_experts or 0, expert_alignment, self.timeout_ns
        )
        count_matrix_host = None
        per_expert_list: List[int] = []
        x_row, scale_row = x.size(1) * x.element_size(), 0 if x_scales is None else x_scales.size(1) * 4
        num_topk = 0 if topk_idx is None else topk_idx.size(1)
        if num_worst_tokens == 0:
            count_matrix_host = count_matrix.cpu()  # the host must know how many rows to allocate
            rows_out = int(count_matrix_host[:, self.rank].sum())
            self._check_capacity(
                count_matrix_host.sum(0).max(), self.ipc.dispatch_capacity(x_row, scale_row, num_topk), "dispatch"
            )
            if per_expert is not None:
                per_expert_list = per_expert.tolist()
        else:
            rows_out = num_worst_tokens
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx = _C.intranode_dispatch(
            self.ipc,
            x,
            x_scales,
            topk_idx,
            topk_weights,
            (num_experts or self.num_ranks) // self.num_ranks,
            is_token_in_rank,
            send_pos,
            count_matrix,
            rows_out,
            num_sms,
            self.timeout_ns,
            False,
        )
        handle = DispatchHandle(
            buffer_id=buffer_id,
            num_ranks=self.num_ranks,
            rank_prefix_matrix=torch.cumsum(count_matrix, dim=0, dtype=torch.int32),
            recv_src_idx=recv_src_idx,
            is_token_in_rank=is_token_in_rank,
            num_recv_tokens=rows_out if num_worst_tokens == 0 else -1,
            num_recv_tokens_per_expert=per_expert,
            num_worst_tokens=num_worst_tokens,
            expert_alignment=expert_alignment,
            backend_state={
                "engine": "cuda",
                "count_matrix": count_matrix,
                "count_matrix_host": count_matrix_host,
                "send_pos": send_pos,
            },
        )
        return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert_list, handle

    def _check_capacity(self, needed, capacity: int, what: str) -> None:
        needed = int(needed)
        if needed > capacity:
            raise ValueError(
                f"num_nvl_bytes: this {what} needs {needed} rows on some rank but the buffer holds {capacity} rows "
                f"of this shape ({self.ipc.data_bytes} data bytes); create the Buffer with more num_nvl_bytes"
            )

    def cached_dispatch(self, x, x_scales, handle: DispatchHandle, config=None):
        state = handle.backend_state
        if not (self._uses_engine(x) and state.get("engine") == "cuda"):
            return super().cached_dispatch(x, x_scales, self._reference_view(handle))
        num_sms = (config or Config()).num_sms
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
            True,
        )
        return recv_x, recv_scales

    def combine(self, x, handle: DispatchHandle, topk_weights, bias: Sequence[torch.Tensor], config=None):
        state = handle.backend_state
        if not (self._uses_engine(x) and state.get("engine") == "cuda" and x.dtype in _COMBINE_DTYPES):
            return super().combine(x, self._reference_view(handle), topk_weights, bias)
        num_sms = (config or Config()).num_sms
        host = state["count_matrix_host"]
        if host is not None:
            num_topk = 0 if topk_weights is None else topk_weights.size(1)
            self._check_capacity(
                host.sum(1).max(), self.ipc.combine_capacity(x.size(1) * x.element_size(), num_topk), "combine"
            )
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


def has_nvshmem() -> bool:
    """Whether the engine was built with NVSHMEM (internode and low-latency kernels need it)."""
    return bool(_C.has_nvshmem())
