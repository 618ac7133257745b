"""CUDA backend: the ``ep_dispatcher._C`` engines, one module each, and the one place that routes between them and
the reference implementation.

* ``intranode.py``: dispatch/combine inside one NVLink domain, over CUDA-IPC buffers (``IntranodeEngine``);
* ``internode.py``: dispatch/combine across nodes, NVSHMEM + NVLink forwarding (``InternodeEngine``);
* ``low_latency.py``: low-latency dispatch/combine over an NVSHMEM symmetric buffer (``LowLatencyEngine``), and the
  GPU-sharing discovery that bounds its grid;
* ``nvshmem.py``: process-wide NVSHMEM initialisation and symmetric-heap accounting;
* ``common.py``: what the intranode and internode engines share (handle, SM count, the reference view of a handle).

``CudaBackend`` holds a ``ReferenceBackend`` and serves with it every call no engine covers (fp16/fp64 combine, CPU
tensors, a buffer without the engine's memory, handles the reference made): ``_route`` decides, and
``engine_calls()`` reads the same table, so a ``Buffer`` always works and says which calls are kernels.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict, Optional, Union

import torch
import torch.distributed as dist

from ... import _C, settings
from ...expert_major import permute_rows, to_expert_major, unpermute_sum
from ...handles import DispatchHandle, LowLatencyHandle
from ..base import CombineArgs, DispatchArgs, LowLatencyCombineArgs, LowLatencyDispatchArgs
from ..reference import ReferenceBackend
from .common import COMBINE_DTYPES, EngineContext, reference_view
from .internode import (
    InternodeEngine,
    InternodeState,
    internode_engine_enabled,
    internode_hidden_bytes,
    internode_send_positions,
)
from .intranode import IntranodeEngine, IntranodeState
from .low_latency import LowLatencyEngine, LowLatencyState, low_latency_max_blocks, ranks_sharing_this_gpu
from .nvshmem import has_nvshmem

__all__ = [
    "COMBINE_DTYPES",
    "CudaBackend",
    "EngineContext",
    "InternodeEngine",
    "InternodeState",
    "IntranodeEngine",
    "IntranodeState",
    "LowLatencyEngine",
    "LowLatencyState",
    "has_nvshmem",
    "internode_engine_enabled",
    "internode_hidden_bytes",
    "internode_send_positions",
    "low_latency_max_blocks",
    "ranks_sharing_this_gpu",
    "reference_view",
]


class _LayoutKernel:
    """The layout kernel (csrc/kernels/layout.cu): counts per rank/node/expert and ``is_token_in_rank``, no host
    sync; it needs no memory of its own, so every CUDA backend has it."""

    def __init__(self, num_ranks: int, num_ranks_per_node: int):
        self.num_ranks = num_ranks
        self.num_ranks_per_node = num_ranks_per_node

    def made(self, state: object) -> bool:
        return False

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        return _C.get_dispatch_layout(topk_idx, num_experts, self.num_ranks, self.num_ranks_per_node)


_Engine = Union[_LayoutKernel, IntranodeEngine, InternodeEngine, LowLatencyEngine]


class CudaBackend:
    """The ``Backend`` (``backends/base.py``) of the ``_C`` engines; what they do not cover runs on ``reference``.

    ``engine_options`` are accepted (as DeepEP's extra options) and ignored: there are none.
    """

    name = "cuda"
    float_dtypes = ReferenceBackend.float_dtypes  # the reference serves the dtypes the kernels do not sum

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
        self.reference = ReferenceBackend(group, rank, num_ranks, num_ranks_per_node)
        self.group = group
        self.rank = rank
        self.num_ranks = num_ranks
        self.num_ranks_per_node = num_ranks_per_node
        self.timeout_ns = int(timeout_s * 1e9)
        ctx = EngineContext(group, rank, num_ranks, num_ranks_per_node, self.timeout_ns)
        self.layout = _LayoutKernel(num_ranks, num_ranks_per_node)
        self.layout_kernel = self.layout.get_dispatch_layout  # Buffer.get_dispatch_layout's hot path (CUDA tensors)
        self.intranode: Optional[IntranodeEngine] = None
        if num_nvl_bytes > 0 and num_ranks <= num_ranks_per_node:
            self.intranode = IntranodeEngine(ctx, num_nvl_bytes)
        self.low_latency: Optional[LowLatencyEngine] = None
        self.internode: Optional[InternodeEngine] = None
        if num_rdma_bytes > 0 and _C.has_nvshmem() and low_latency_mode:
            self.low_latency = LowLatencyEngine(ctx, num_rdma_bytes, allow_nvlink)
        elif num_rdma_bytes > 0 and _C.has_nvshmem() and num_ranks > num_ranks_per_node and internode_engine_enabled():
            self.internode = InternodeEngine(ctx, num_rdma_bytes)

    # The engines' device buffers, by the names tests and benchmarks use (None without that engine).
    @property
    def ipc(self) -> Optional["_C.IpcBuffer"]:
        return None if self.intranode is None else self.intranode.ipc

    @property
    def ll(self) -> Optional["_C.LowLatencyBuffer"]:
        return None if self.low_latency is None else self.low_latency.buffer

    # ------------------------------------------------------------------ routing: the one place that falls back
    def _high_throughput(self) -> Optional[_Engine]:
        return self.internode if self.internode is not None else self.intranode

    def _fused(self) -> Optional[_Engine]:
        # The fused expert-major kernels exist on the intranode engine only, behind EP_DISPATCHER_FUSED_EXPERT_MAJOR
        # (settings.py).
        return self.intranode if self.internode is None and settings.fused_expert_major() else None

    # Which engine serves each call when its tensors are on the GPU (None: no engine, the reference serves it). One
    # getter per call: routing a call asks only its own (decode calls are routed every step, and _fused reads the
    # environment).
    _ENGINE_OF: Dict[str, Callable[["CudaBackend"], Optional[_Engine]]] = {
        "get_dispatch_layout": lambda b: b.layout,
        "dispatch": _high_throughput,
        "cached_dispatch": _high_throughput,
        "combine": _high_throughput,
        "dispatch_expert_major": _fused,
        "cached_dispatch_expert_major": _fused,
        "combine_expert_major": _fused,
        "low_latency_dispatch": lambda b: b.low_latency,
        "low_latency_combine": lambda b: b.low_latency,
    }

    def _engines(self) -> Dict[str, Optional[_Engine]]:
        """Which engine serves each call when its tensors are on the GPU (None: no engine, the reference serves it)."""
        return {call: engine_of(self) for call, engine_of in self._ENGINE_OF.items()}

    def engine_calls(self) -> tuple:
        """The calls that run as CUDA kernels on this buffer (for GPU tensors; the rest run on the reference)."""
        return tuple(call for call, engine in self._engines().items() if engine is not None)

    def _route(
        self,
        call: str,
        device: torch.device,
        handle: Union[DispatchHandle, LowLatencyHandle, None] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> Optional[_Engine]:
        """The engine that serves ``call``, or None when ``self.reference`` does: when this buffer has no engine
        for it, its tensors are not on the GPU, the ``handle`` it reuses was not made by that engine (e.g. a
        dispatch of CPU tensors), or (``dtype``, combine) the kernels do not sum that dtype (fp16, fp64)."""
        return self._route_on(call, device.type == "cuda", handle, dtype)

    def _route_on(
        self,
        call: str,
        on_gpu: bool,
        handle: Union[DispatchHandle, LowLatencyHandle, None] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> Optional[_Engine]:
        """``_route`` given whether the call's tensors are on the GPU (``tensor.is_cuda`` costs far less than
        ``device.type``: the decode calls pass it)."""
        engine_of = self._ENGINE_OF.get(call)
        engine = None if engine_of is None or not on_gpu else engine_of(self)
        if engine is None:
            return None
        if handle is not None and not engine.made(handle.backend_state):
            return None
        if dtype is not None and dtype not in engine.combine_dtypes:
            return None
        return engine

    # ------------------------------------------------------------------ lifetime and checks
    def destroy(self) -> None:
        if self.intranode is not None:
            self.intranode.destroy()
            self.intranode = None
        if self.low_latency is not None:
            self.low_latency.destroy()
            self.low_latency = None
        if self.internode is not None:
            self.internode.destroy()
            self.internode = None

    def checks_topk_idx_on_device(self, call: str, topk_idx: torch.Tensor) -> bool:
        """The layout kernel ignores ids outside ``[0, num_experts)``, the intranode dispatch reports them (every
        rank raises ``ValueError`` after the count exchange), and the low-latency kernels skip bad ids and experts
        listed twice by a token and report them through ``take_low_latency_error``: none needs a host sync."""
        if not topk_idx.is_cuda:
            return False
        if call == "low_latency":
            return self.low_latency is not None
        return call == "get_dispatch_layout" or (call == "dispatch" and self.intranode is not None)

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        engine = self._route("get_dispatch_layout", topk_idx.device)
        if engine is None:
            return self.reference.get_dispatch_layout(topk_idx, num_experts)
        return engine.get_dispatch_layout(topk_idx, num_experts)

    # ------------------------------------------------------------------ high-throughput dispatch / combine
    def dispatch(self, args: DispatchArgs):
        engine = self._route("dispatch", args.x.device)
        return (self.reference if engine is None else engine).dispatch(args)

    def cached_dispatch(self, x, x_scales, handle: DispatchHandle, config=None):
        engine = self._route("cached_dispatch", x.device, handle=handle)
        if engine is None:
            return self.reference.cached_dispatch(x, x_scales, reference_view(handle, self.rank))
        return engine.cached_dispatch(x, x_scales, handle, config)

    def combine(self, args: CombineArgs):
        engine = self._route("combine", args.x.device, handle=args.handle, dtype=args.x.dtype)
        if engine is None:
            return self.reference.combine(replace(args, handle=reference_view(args.handle, self.rank)))
        return engine.combine(args)

    # ------------------------------------------------------------------ expert-major dispatch / combine (fused permute)
    # The fused intranode kernels when ``_route`` gives the engine (EP_DISPATCHER_FUSED_EXPERT_MAJOR=1, intranode
    # buffer, GPU tensors; cached dispatch and combine also need a handle the fused dispatch made, and combine a dtype
    # the engine sums): the dispatch writes rows straight into expert-major slots (aligned expert base + earlier source
    # ranks' pairs for the expert + the pair's position among this source's pairs for it), the combine sums each
    # token's expert-major rows while it pushes the token back (fused un-permute). Otherwise the FALLBACK: the routed
    # dispatch / cached dispatch / combine above (engine or reference) plus a device gather (permute) and a fixed-order
    # device sum (un-permute) from ep_dispatcher/expert_major.py, i.e. the reference composition on the engine's
    # outputs: bit-identical to the specification, but the permute pass still happens inside the call.
    def dispatch_expert_major(self, args: DispatchArgs):
        engine = self._route("dispatch_expert_major", args.x.device)
        if engine is not None:
            return engine.dispatch_expert_major(args)
        return to_expert_major(self.dispatch(args), args.num_experts // self.num_ranks, args.expert_alignment)

    def cached_dispatch_expert_major(self, x, x_scales, handle: DispatchHandle, config=None):
        engine = self._fused_handle("cached_dispatch_expert_major", x.device, handle)
        if engine is not None:
            return engine.cached_dispatch_expert_major(x, x_scales, handle, config=config)
        recv, recv_scales = self.cached_dispatch(x, x_scales, handle, config=config)
        return permute_rows(recv, handle.expert_major), permute_rows(recv_scales, handle.expert_major)

    def combine_expert_major(self, args: CombineArgs):
        engine = self._fused_handle("combine_expert_major", args.x.device, args.handle, dtype=args.x.dtype)
        if engine is not None:
            return engine.combine_expert_major(args)
        return self.combine(replace(args, x=unpermute_sum(args.x, args.handle.expert_major)))

    def _fused_handle(
        self, call: str, device: torch.device, handle: DispatchHandle, dtype: Optional[torch.dtype] = None
    ) -> Optional[IntranodeEngine]:
        """The intranode engine when ``call`` routes to it and ``handle`` came from its fused expert-major dispatch
        (only that one keeps the pair table; a handle the fallback made is served by the fallback), else None."""
        engine = self._route(call, device, handle=handle, dtype=dtype)
        if engine is None or getattr(handle.backend_state, "expert_pairs", None) is None:
            return None
        return engine

    # ------------------------------------------------------------------ low-latency dispatch / combine
    def take_low_latency_error(self) -> Optional[tuple]:
        """``(code, token, k, value)`` of the last bad ``topk_idx`` entry the kernels that have run reported (then
        cleared), or None; codes in ``validation.low_latency_topk_error``."""
        return None if self.low_latency is None else self.low_latency.take_error()

    def low_latency_dispatch(self, args: LowLatencyDispatchArgs):
        engine = self._route_on("low_latency_dispatch", args.x.is_cuda)
        return (self.reference if engine is None else engine).low_latency_dispatch(args)

    def low_latency_combine(self, args: LowLatencyCombineArgs):
        engine = self._route_on("low_latency_combine", args.x.is_cuda, args.handle)
        return (self.reference if engine is None else engine).low_latency_combine(args)

    def low_latency_combine_buffer(self, half: int, shape, device: torch.device) -> torch.Tensor:
        engine = self._route("low_latency_combine", device)
        if engine is None:
            return self.reference.low_latency_combine_buffer(half, shape, device)
        return engine.combine_buffer(half, shape, device)

    def logfmt_roundtrip(self, x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """LogFMT-10 round trip by the kernel (csrc/kernels/logfmt.cu, bit-exact with the reference). Buffer runs it
        as an extra pass before the combine kernel (use_logfmt=True); fusing the encode into combine_send would save
        that pass and shrink the messages to 10 bits per channel. A standalone kernel (no engine memory, not in
        ``engine_calls``): the reference serves CPU and non-contiguous tensors."""
        if not x.is_cuda or not x.is_contiguous():
            return self.reference.logfmt_roundtrip(x, inplace)
        return _C.logfmt_roundtrip(x, inplace)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        if self.low_latency is not None:
            self.low_latency.clean()
