"""What the engines share: the group they serve (``EngineContext``); and for the intranode and internode engines the
combine dtypes, the SM count of a call, the handle they return, and the reference view of that handle (for the calls
the reference backend serves instead)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ... import _C
from ...config import Config
from ...handles import DispatchHandle
from ..base import DispatchArgs
from ..reference import ReferenceDispatchState

COMBINE_DTYPES = (torch.bfloat16, torch.float32)  # dtypes the combine kernels sum


@dataclass(frozen=True)
class EngineContext:
    """The group an engine serves, as ``CudaBackend`` was given it: the process group, this rank, the group size, the
    ranks per NVLink domain, and the device waits' timeout in nanoseconds (``Buffer``'s timeout)."""

    group: dist.ProcessGroup
    rank: int
    num_ranks: int
    num_ranks_per_node: int
    timeout_ns: int


def host_read_naming_timeouts(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.cpu()`` for a read the host waits on. If the stream faulted because a kernel's wait timed out, the
    ``RuntimeError`` names rank, peer and stage (the kernels' timeout record, which survives the trap)."""
    try:
        return tensor.cpu()
    except RuntimeError as error:
        report = _C.timeout_report()
        if not report:
            raise
        raise RuntimeError(f"{report}; {error}") from error


def check_engine_limit(argument: str, value: int, limit: int, engine: str, unit: str = "ranks") -> None:
    """``ValueError`` naming ``argument`` when ``value`` exceeds what the ``engine`` engine's kernels support."""
    if value > limit:
        raise ValueError(f"{argument}: the {engine} engine supports up to {limit} {unit}, got {value}")


def kernel_num_sms(config: Optional[Config]) -> int:
    """SMs of a data kernel: the call's config. ``Buffer`` always passes one (``Buffer.get_dispatch_config`` /
    ``get_combine_config``, built from ``Buffer.num_sms``, unless the caller gives its own); ``Config()``'s default
    only serves a backend called directly."""
    return (config or Config()).num_sms


def engine_dispatch_handle(
    args: DispatchArgs,
    rank: int,
    num_ranks_per_node: int,
    count_matrix: torch.Tensor,
    recv_src_idx: torch.Tensor,
    rows_out: int,
    per_expert: Optional[torch.Tensor],
    state: Any,
    rank_prefix_matrix: Optional[torch.Tensor] = None,
) -> DispatchHandle:
    """The handle of the dispatch ``args`` an engine ran; ``state`` (a frozen dataclass of the engine) is what its
    cached dispatch and combine reuse."""
    if rank_prefix_matrix is None:
        rank_prefix_matrix = torch.cumsum(count_matrix, dim=0, dtype=torch.int32)
    return DispatchHandle(
        buffer_id=args.buffer_id,
        num_ranks=count_matrix.size(0),
        rank_prefix_matrix=rank_prefix_matrix,
        recv_src_idx=recv_src_idx,
        is_token_in_rank=args.is_token_in_rank,
        num_recv_tokens=rows_out if args.num_worst_tokens == 0 else -1,
        num_recv_tokens_per_expert=per_expert,
        num_worst_tokens=args.num_worst_tokens,
        expert_alignment=args.expert_alignment,
        backend_state=state,
        rank=rank,
        num_ranks_per_node=num_ranks_per_node,
    )


def reference_view(handle: DispatchHandle, rank: int) -> DispatchHandle:
    """``handle`` as the reference backend needs it: itself when the reference made it, else a new handle whose state
    the reference computes from the engine's count matrix (one host sync when the host does not hold the matrix).
    ``handle`` itself is left unchanged."""
    state = handle.backend_state
    if isinstance(state, ReferenceDispatchState):
        return handle
    matrix = state.count_matrix_host
    if matrix is None:
        matrix = state.count_matrix.cpu()
    _, token = torch.nonzero(handle.is_token_in_rank.t(), as_tuple=True)
    return handle.with_backend_state(
        ReferenceDispatchState(
            send_idx=token,
            send_counts=matrix[rank].tolist(),
            recv_counts=matrix[:, rank].tolist(),
            num_recv=int(matrix[:, rank].sum()),
        )
    )
