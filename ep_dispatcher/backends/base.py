"""The backend interface: every call ``Buffer`` makes on a backend, and nothing else.

Two backends implement it: ``reference.ReferenceBackend`` (pure PyTorch + torch.distributed, the executable
specification) and ``cuda.CudaBackend`` (the ``_C`` engines, which falls back to a reference backend it holds for
what its kernels do not cover). ``Buffer`` validates every argument before it calls a backend, so a backend may
assume well-formed shapes, dtypes and devices; tensor *contents* are checked by ``Buffer`` unless
``checks_topk_idx_on_device`` says the backend checks them itself.

Handles carry a ``backend_state``: a frozen dataclass of the backend (and engine) that made the handle, opaque to
everyone else. A fresh dispatch's arguments travel as one frozen ``DispatchArgs`` (a low-latency dispatch's as one
``LowLatencyDispatchArgs``), a combine's as one ``CombineArgs`` (``LowLatencyCombineArgs``), built once by ``Buffer``
and passed unchanged to whichever engine or reference serves it. The low-latency ones are ``NamedTuple``s: as
immutable, and built on every decode call, where a frozen dataclass's ``__init__`` costs several times more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, NamedTuple, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch

from ..config import Config
from ..handles import DispatchHandle, LowLatencyHandle

# low_latency_dispatch returns this: receive() fills the outputs it returned with it (the receive phase).
LowLatencyDispatchReceive = Callable[[], None]
# low_latency_combine returns this: receive() writes the [num_tokens, hidden] result it returned with it (the receive
# phase).
LowLatencyCombineReceive = Callable[[], None]
# A low-latency dispatch's outputs: (recv_x [E_local, num_ranks * max_tokens, hidden] float8_e4m3fn or bfloat16,
# recv_scales or None, recv_count [E_local] int32), laid out as low_latency_state.allocate_dispatch_outputs lays them.
LowLatencyDispatchOutputs = Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class DispatchArgs:
    """One fresh (non-cached) high-throughput dispatch, as ``Buffer.dispatch`` checked it.

    x: ``[num_tokens, hidden]`` payload rows (any dtype, rows a multiple of 16 bytes); x_scales: ``[num_tokens,
    num_scales]`` or None; is_token_in_rank: ``[num_tokens, num_ranks] bool``; num_tokens_per_rank: ``[num_ranks]
    int32`` or None (must equal ``is_token_in_rank.sum(0)``: every backend raises ``ValueError`` naming it when it does
    not); topk_idx ``[num_tokens, num_topk] int64`` / topk_weights ``float32``, or both None; num_experts: from
    ``num_tokens_per_expert`` (None without it); num_worst_tokens: 0, or the fixed receive row count (no host sync);
    buffer_id: the ``Buffer`` the handle belongs to; config: the call's launch config (its ``num_sms``).
    """

    x: torch.Tensor
    x_scales: Optional[torch.Tensor]
    is_token_in_rank: torch.Tensor
    num_tokens_per_rank: Optional[torch.Tensor]
    topk_idx: Optional[torch.Tensor]
    topk_weights: Optional[torch.Tensor]
    num_experts: Optional[int]
    expert_alignment: int
    num_worst_tokens: int
    buffer_id: int
    config: Optional[Config] = None
    num_tokens_per_expert: Optional[torch.Tensor] = None


class LowLatencyDispatchArgs(NamedTuple):
    """One low-latency dispatch, as ``Buffer.low_latency_dispatch`` checked it.

    x: ``[num_tokens, hidden] bfloat16``; topk_idx: ``[num_tokens, num_topk] int64``; half: the buffer half (0 or 1);
    cumulative_stats: optional ``[num_local_experts] int32`` the receive phase adds the counts to; wait_stats: optional
    ``[num_ranks] int64`` (cycles spun per source rank); receive_now: the caller runs ``receive()`` at once (no
    hook), so an engine may launch both phases together and make ``receive()`` do nothing.
    """

    x: torch.Tensor
    topk_idx: torch.Tensor
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool
    buffer_id: int
    half: int = 0
    cumulative_stats: Optional[torch.Tensor] = None
    wait_stats: Optional[torch.Tensor] = None
    receive_now: bool = False

    def make_handle(
        self, src_info: torch.Tensor, layout_range: torch.Tensor, backend_state: object
    ) -> LowLatencyHandle:
        """The handle of this dispatch: its sizes, the receive layout (``src_info``, ``layout_range``) and the state of
        the backend that ran it."""
        x_shape = self.x.shape
        return LowLatencyHandle(
            self.buffer_id,
            src_info,
            layout_range,
            self.num_max_dispatch_tokens_per_rank,
            x_shape[1],
            self.num_experts,
            x_shape[0],
            self.topk_idx.shape[1],
            backend_state,
        )


@dataclass(frozen=True)
class CombineArgs:
    """One high-throughput combine (received order, or expert-major), as ``Buffer.combine`` checked it.

    x: ``[num_recv_rows, hidden]`` (expert-major: ``[M, hidden]``) in one of the backend's ``float_dtypes``; handle:
    the dispatch's; topk_weights: ``[num_recv_rows, num_topk] float32`` or None; bias: zero, one or two
    ``[num_tokens, hidden]`` tensors of ``x``'s dtype; config: the call's launch config (its ``num_sms``).
    """

    x: torch.Tensor
    handle: DispatchHandle
    topk_weights: Optional[torch.Tensor] = None
    bias: Sequence[torch.Tensor] = ()
    config: Optional[Config] = None


class LowLatencyCombineArgs(NamedTuple):
    """One low-latency combine, as ``Buffer.low_latency_combine`` checked it.

    x: ``[num_local_experts, num_ranks * max_tokens, hidden] bfloat16``; topk_idx ``[num_tokens, num_topk] int64`` /
    topk_weights ``float32``: as dispatched; handle: the dispatch's; half: the buffer half (0 or 1); wait_stats:
    optional ``[num_ranks] int64`` (cycles spun per source rank); out: the caller's ``[num_tokens, hidden] bfloat16``
    destination, or None (the backend allocates it); receive_now: as ``LowLatencyDispatchArgs``'.
    """

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    handle: LowLatencyHandle
    half: int = 0
    wait_stats: Optional[torch.Tensor] = None
    out: Optional[torch.Tensor] = None
    receive_now: bool = False


@runtime_checkable
class Backend(Protocol):
    """What ``Buffer`` calls on a backend.

    Optional: ``destroy()`` (a backend that owns device memory frees it there; ``Buffer.destroy`` runs a group
    barrier before it, and only for a backend that has it); ``layout_kernel(topk_idx, num_experts)`` (what
    ``get_dispatch_layout`` returns for well-formed CUDA inputs, called by ``Buffer`` without further checks).
    """

    name: str  # "reference" or "cuda"
    float_dtypes: Tuple[torch.dtype, ...]  # payload dtypes combine accepts

    def engine_calls(self) -> tuple:
        """Names of the calls this backend runs as CUDA kernels (the rest run the reference implementation)."""
        ...

    def checks_topk_idx_on_device(self, call: str, topk_idx: torch.Tensor) -> bool:
        """Whether ``call`` ("get_dispatch_layout", "dispatch", "low_latency") checks the range of ``topk_idx``
        itself, on the device without a host sync; when False, ``Buffer`` checks it on the host."""
        ...

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> tuple:
        """``(num_tokens_per_rank, num_tokens_per_rdma_rank or None, num_tokens_per_expert, is_token_in_rank)``."""
        ...

    def dispatch(self, args: DispatchArgs) -> tuple:
        """``(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert_list, handle)``."""
        ...

    def cached_dispatch(
        self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: DispatchHandle, config=None
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(recv_x, recv_x_scales)`` with the layout of ``handle``."""
        ...

    def combine(self, args: CombineArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(combined_x, combined_topk_weights or None)``."""
        ...

    def dispatch_expert_major(self, args: DispatchArgs) -> tuple:
        """As ``dispatch`` (``args.num_worst_tokens == 0``) with ``recv_x`` / ``recv_x_scales`` expert-major
        ``[M, ...]`` and the layout in ``handle.expert_major`` (fused permute; ``ep_dispatcher/expert_major.py``)."""
        ...

    def cached_dispatch_expert_major(
        self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: DispatchHandle, config=None
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(recv_x [M, ...], recv_x_scales)`` in the expert-major layout of ``handle``."""
        ...

    def combine_expert_major(self, args: CombineArgs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Combine of an expert-major ``args.x [M, hidden]`` (each token's rows summed in row order first)."""
        ...

    def low_latency_dispatch(
        self, args: LowLatencyDispatchArgs
    ) -> Tuple[LowLatencyHandle, LowLatencyDispatchOutputs, LowLatencyDispatchReceive]:
        """Launch the send phase and allocate the outputs; returns ``(handle, (recv_x, recv_scales, recv_count),
        receive)``; ``receive()`` fills them."""
        ...

    def low_latency_combine(self, args: LowLatencyCombineArgs) -> Tuple[torch.Tensor, LowLatencyCombineReceive]:
        """Launch the send phase; returns ``(out, receive)``: ``out`` is ``args.out`` or, when that is None, a new
        ``[num_tokens, hidden] bfloat16`` tensor on ``x``'s device; ``receive()`` writes it."""
        ...

    def low_latency_combine_buffer(self, half: int, shape: Tuple[int, int, int], device: torch.device) -> torch.Tensor:
        """The zero-copy combine input of buffer half ``half`` (persistent across calls)."""
        ...

    def logfmt_roundtrip(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """``x`` encoded to LogFMT-10 and decoded; written back into ``x`` if ``inplace``."""
        ...

    def take_low_latency_error(self) -> Optional[tuple]:
        """``(code, token, k, value)`` of a bad ``topk_idx`` entry a low-latency kernel reported (then cleared), or
        None."""
        ...

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset the low-latency buffer's signal area (collective)."""
        ...


__all__: List[str] = [
    "Backend",
    "CombineArgs",
    "DispatchArgs",
    "LowLatencyCombineArgs",
    "LowLatencyCombineReceive",
    "LowLatencyDispatchArgs",
    "LowLatencyDispatchOutputs",
    "LowLatencyDispatchReceive",
]
