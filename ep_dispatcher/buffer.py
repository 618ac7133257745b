"""``Buffer``: the one public entry point for expert-parallel communication.

Names, arguments and return values follow DeepEP's ``deep_ep.Buffer`` so existing code switches by changing
the import. ``Buffer`` validates every argument (``TypeError``/``ValueError`` naming the argument, the value it
got and what it expects), runs the call (on the communication stream when the caller overlaps it with
``previous_event`` or ``async_finish``, else on the current stream), and hands it to a backend: ``"cuda"`` (the
``ep_dispatcher._C`` engine) or ``"reference"`` (pure PyTorch + torch.distributed).
"""

from __future__ import annotations

import itertools
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import config as _config
from .backends.base import CombineArgs, DispatchArgs, LowLatencyCombineArgs, LowLatencyDispatchArgs
from . import settings
from .config import NUM_MAX_TOPK, Config
from .handles import DispatchHandle, LowLatencyHandle
from .overlap import EventOverlap
from .low_latency_state import LowLatencyCalls
from .streams import CommStream, check_event
from .validation import (
    check_int,
    check_tensor,
    check_topk_idx_range,
    payload_for_backend,
    split_fp8,
)

DEFAULT_TIMEOUT_S = settings.DEFAULT_TIMEOUT_S
_BACKENDS = ("auto", "cuda", "reference")
_buffer_ids = itertools.count(1)

FloatPayload = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def _extension_error() -> Optional[str]:
    """``None`` if the CUDA engine can run here, else why not."""
    try:
        from . import _C  # noqa: F401
    except ImportError as e:
        return f"the extension ep_dispatcher._C is not built ({e}); reinstall with nvcc and a CUDA build of torch"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


class Buffer:
    """Communication buffer of one rank of an expert-parallel group.

    Args:
        group: the expert-parallel process group (``None`` = the default group).
        num_nvl_bytes: NVLink (CUDA IPC) buffer bytes for high-throughput kernels; see
            ``Config.get_nvl_buffer_size_hint``.
        num_rdma_bytes: NVSHMEM buffer bytes for internode and low-latency kernels; see
            ``Config.get_rdma_buffer_size_hint`` and ``Buffer.get_low_latency_rdma_size_hint``.
        low_latency_mode: enables the ``low_latency_*`` calls.
        num_qps_per_rank: accepted for DeepEP compatibility (checked to be >= 1, kept as ``self.num_qps_per_rank``),
            and tunes nothing: no engine reads it (internode and low-latency traffic goes through NVSHMEM, which its
            own environment variables configure).
        allow_nvlink_for_low_latency_mode: low-latency kernels use NVLink P2P to peers that have it.
        allow_mnnvl: accepted for DeepEP compatibility (kept as ``self.allow_mnnvl``), and does nothing: a node is
            ``num_ranks_per_node`` ranks; to treat a multi-node NVLink domain as one node, set that instead.
        explicitly_destroy: accepted for DeepEP compatibility (kept as ``self.explicitly_destroy``), and does
            nothing: resources are always freed by ``destroy()`` (collective), or with the process; there is no
            destructor that frees them at garbage collection.
        comm: an ``mpi4py.MPI.Comm`` used when ``group`` is None (as DeepEP): its ranks become the group (the
            default torch.distributed group is initialised from it if needed; see ``compat.group_from_comm``).
        backend: ``"auto"`` (CUDA engine when built and a GPU is visible, else reference), ``"cuda"`` or
            ``"reference"``.
        num_ranks_per_node: ranks of one NVLink domain (default: env ``EP_DISPATCHER_RANKS_PER_NODE`` or 8).
        timeout_s: how long a kernel waits for a peer before failing with rank and stage (default: env
            ``EP_DISPATCHER_TIMEOUT_S`` or 100 s).
        validate_inputs: also check values that live on the device (``topk_idx`` range); costs one host
            sync per call on a GPU and is skipped automatically during CUDA-graph capture. The low-latency kernels
            check ``topk_idx`` on the device instead (always, no sync; see ``low_latency_dispatch``).

    The backends' constructors also accept ``**engine_options`` (DeepEP-style extra options) and ignore them: none
    exist. SMs: ``Buffer.num_sms`` (``set_num_sms``) feeds the default ``Config`` of every high-throughput call
    (``get_dispatch_config`` / ``get_combine_config``); a ``config=`` passed to a call replaces it.
    """

    num_sms: int = 20

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        comm=None,
        backend: str = "auto",
        num_ranks_per_node: Optional[int] = None,
        timeout_s: Optional[float] = None,
        validate_inputs: bool = True,
    ):
        if group is None and comm is not None:
            from .compat import group_from_comm

            group = group_from_comm(comm)
        self.comm = comm
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "Buffer: torch.distributed is not initialised; call "
                "torch.distributed.init_process_group(...) before creating a Buffer, or pass comm= (an mpi4py "
                "communicator)"
            )
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.num_nvl_bytes = check_int("num_nvl_bytes", num_nvl_bytes, minimum=0)
        self.num_rdma_bytes = check_int("num_rdma_bytes", num_rdma_bytes, minimum=0)
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = check_int("num_qps_per_rank", num_qps_per_rank, minimum=1)
        self.allow_nvlink_for_low_latency_mode = bool(allow_nvlink_for_low_latency_mode)
        self.allow_mnnvl = bool(allow_mnnvl)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.validate_inputs = bool(validate_inputs)
        if num_ranks_per_node is None:
            num_ranks_per_node = _config.default_ranks_per_node()
        self.num_ranks_per_node = check_int("num_ranks_per_node", num_ranks_per_node, minimum=1)
        if self.group_size > self.num_ranks_per_node and self.group_size % self.num_ranks_per_node != 0:
            raise ValueError(
                f"num_ranks_per_node: the group has {self.group_size} ranks, which is not a multiple of "
                f"num_ranks_per_node={self.num_ranks_per_node}"
            )
        if timeout_s is None:
            timeout_s = settings.timeout_s()
        if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)

        if backend not in _BACKENDS:
            raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
        why_not_cuda = _extension_error()
        if backend == "cuda" and why_not_cuda:
            raise RuntimeError(f"backend='cuda' is unavailable: {why_not_cuda}; use backend='reference' or 'auto'")
        use_cuda = backend == "cuda" or (backend == "auto" and why_not_cuda is None)
        if use_cuda:
            from .backends.cuda import CudaBackend

            self._backend = CudaBackend(
                self.group,
                self.rank,
                self.group_size,
                self.num_ranks_per_node,
                num_nvl_bytes=self.num_nvl_bytes,
                num_rdma_bytes=self.num_rdma_bytes,
                low_latency_mode=self.low_latency_mode,
                allow_nvlink=self.allow_nvlink_for_low_latency_mode,
                timeout_s=self.timeout_s,
            )
        else:
            from .backends.reference import ReferenceBackend

            self._backend = ReferenceBackend(self.group, self.rank, self.group_size, self.num_ranks_per_node)
        self.buffer_id = next(_buffer_ids)
        self._comm = CommStream()  # the communication stream, created on first use
        self._local_buffers: dict = {}  # get_local_buffer_tensor's scratch tensors, by which size they mirror
        self._destroyed = False
        # The layout kernel's entry (a CUDA backend's), for get_dispatch_layout's hot path; None after destroy().
        self._layout_kernel: Optional[Callable] = getattr(self._backend, "layout_kernel", None)
        self._ll = LowLatencyCalls(self._backend, self.clean_low_latency_buffer)  # halves, hooks, shape, receipts

    # ------------------------------------------------------------------ properties and static helpers
    @property
    def backend(self) -> str:
        """Name of the backend serving this buffer: ``"cuda"`` or ``"reference"``."""
        return self._backend.name

    @property
    def engine_calls(self) -> tuple:
        """The calls this buffer runs as CUDA kernels (the rest use the reference implementation)."""
        return self._backend.engine_calls()

    @property
    def num_ranks(self) -> int:
        return self.group_size

    @property
    def is_internode(self) -> bool:
        return self.group_size > self.num_ranks_per_node

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """The most SMs the high-throughput kernels of every buffer occupy (any positive count; DeepEP's even-count
        rule comes from its sender/receiver channel pairs, which our engines do not have)."""
        check_int("new_num_sms", new_num_sms, minimum=1)
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """Tuned dispatch ``Config`` for ``num_ranks`` (from ``configs/``), with ``Buffer.num_sms`` SMs."""
        return _config.load_tuned_config("dispatch", num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """Tuned combine ``Config`` for ``num_ranks`` (from ``configs/``), with ``Buffer.num_sms`` SMs."""
        return _config.load_tuned_config("combine", num_ranks, Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """``num_rdma_bytes`` a low-latency buffer needs for these sizes."""
        return _config.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream, to pass as ``previous_event``."""
        if not torch.cuda.is_available():
            return EventOverlap()
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return EventOverlap(event)

    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether the kernels were built for sm_90 (DeepEP's name; its tests skip FP8 when False). Always True on
        the reference backend, which casts and moves FP8 in PyTorch."""
        from .compat import is_sm90_compiled

        return is_sm90_compiled()

    @property
    def runtime(self):
        """DeepEP's ``buffer.runtime``: an object answering the C++ runtime's methods clients call
        (``get_num_rdma_ranks()``, ``get_rdma_rank()``, ``get_local_device_id()``, ...; ``compat.Runtime``)."""
        from .compat import Runtime

        return Runtime(self)

    def get_comm_stream(self) -> Optional["torch.cuda.Stream"]:
        """The stream this buffer runs its calls on (created on first use; high priority). ``None`` without CUDA."""
        if not torch.cuda.is_available():
            return None
        return self._comm.get(torch.cuda.current_device())

    def get_local_buffer_tensor(
        self,
        dtype: torch.dtype,
        size: Optional[torch.Size] = None,
        offset: int = 0,
        use_rdma_buffer: bool = False,
    ) -> torch.Tensor:
        """A ``dtype`` view of this rank's ``num_nvl_bytes`` (or, with ``use_rdma_buffer``, ``num_rdma_bytes``)
        bytes, from element ``offset``; ``size`` reshapes the first ``size.numel()`` elements (DeepEP's signature).

        Different from DeepEP on purpose: our engines lay out their registered memory per call (rows go straight to
        their final place), so handing it out would let writes corrupt in-flight calls. This is a persistent tensor
        of the same size owned by the Buffer (on the current GPU, else on the CPU), not shared with peers.
        """
        self._check_alive()
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype: expected a torch.dtype, got {type(dtype).__name__}")
        num_bytes = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        which = "num_rdma_bytes" if use_rdma_buffer else "num_nvl_bytes"
        scratch = self._local_buffers.get(which)
        if scratch is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
            scratch = self._local_buffers[which] = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        itemsize = dtype.itemsize
        check_int("offset", offset, minimum=0)
        usable = num_bytes // itemsize - offset
        if usable < 0:
            raise ValueError(f"offset: expected <= {num_bytes // itemsize} elements of {dtype} ({which}), got {offset}")
        tensor = scratch[: num_bytes // itemsize * itemsize].view(dtype)[offset:]
        if size is None:
            return tensor
        numel = torch.Size(size).numel()
        if numel > tensor.numel():
            raise ValueError(
                f"size: {list(size)} needs {numel} elements, the buffer holds {tensor.numel()} from offset {offset}"
            )
        return tensor[:numel].view(size)

    def destroy(self) -> None:
        """Free the buffer's resources; the buffer cannot be used afterwards."""
        if self._destroyed:
            raise RuntimeError("destroy: this Buffer was already destroyed")
        destroy = getattr(self._backend, "destroy", None)
        if destroy is not None:
            dist.barrier(group=self.group)  # collective: no peer may still write into this rank's memory
            destroy()
        self._destroyed = True
        self._layout_kernel = None

    # ------------------------------------------------------------------ shared plumbing
    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this Buffer was destroyed; create a new one")

    def _check_num_experts(self, num_experts) -> int:
        check_int("num_experts", num_experts, minimum=1)
        if num_experts % self.group_size != 0:
            raise ValueError(
                f"num_experts: expected a multiple of the number of ranks ({self.group_size}), got {num_experts}"
            )
        return num_experts

    def _check_topk_idx(
        self, topk_idx, num_tokens: Optional[int], num_experts: int, device, distinct: bool = False, call: str = ""
    ) -> torch.Tensor:
        check_tensor("topk_idx", topk_idx, dtypes=torch.int64, shape=(num_tokens, None), device=device)
        num_topk = topk_idx.shape[1]
        if num_topk > NUM_MAX_TOPK or num_topk < 1:
            raise ValueError(f"topk_idx: expected 1 <= num_topk <= {NUM_MAX_TOPK}, got num_topk={num_topk}")
        # The entries' range is a content check: where the engine makes it on the device (raised where the host waits
        # anyway, or from the next low-latency call or hook), a host-side check would only add a sync.
        if self.validate_inputs and not self._backend.checks_topk_idx_on_device(call, topk_idx):
            check_topk_idx_range(topk_idx, num_experts, distinct=distinct)
        return topk_idx

    def _check_handle(self, handle, kind: type):
        if not isinstance(handle, kind):
            raise TypeError(
                f"handle: expected a {kind.__name__} returned by this Buffer, got {type(handle).__name__}; DeepEP "
                "accepts any tuple of its layout, here pass the handle object the dispatch returned (it is that tuple, "
                "and carries what our engines need besides)"
            )
        if handle.buffer_id != self.buffer_id:
            raise ValueError(
                f"handle: it was created by another Buffer (id {handle.buffer_id}), not this one "
                f"(id {self.buffer_id}); use the buffer that dispatched"
            )
        return handle

    def _check_event(self, previous_event, async_finish: bool, allocate_on_comm_stream: bool) -> None:
        check_event(previous_event, async_finish, allocate_on_comm_stream)

    def _run(self, *args):
        """``streams.CommStream.run(device, previous_event, async_finish, allocate_on_comm_stream, inputs, call)`` on
        this buffer's stream, once the buffer is known to be alive; returns ``(result, EventOverlap)``."""
        self._check_alive()
        return self._comm.run(*args)

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Per-rank / per-expert counts of a routing.

        Args:
            topk_idx: ``[num_tokens, num_topk] int64``, expert ids in ``[-1, num_experts)``; ``-1`` = no expert.
        Returns:
            ``(num_tokens_per_rank [num_ranks] int32, num_tokens_per_rdma_rank [num_nodes] int32 or None,
            num_tokens_per_expert [num_experts] int32, is_token_in_rank [num_tokens, num_ranks] bool, event)``.
            Counts per rank/node are deduplicated per token; ``num_tokens_per_rdma_rank`` is ``None`` unless the
            group spans several nodes.
        """
        kernel = self._layout_kernel
        if (
            kernel is not None
            and previous_event is None
            and not async_finish
            and not allocate_on_comm_stream
            and type(num_experts) is int
            and num_experts > 0
            and num_experts % self.group_size == 0
            and type(topk_idx) is torch.Tensor
            and topk_idx.is_cuda
            and topk_idx.dtype is torch.int64
            and topk_idx.dim() == 2
            and 1 <= topk_idx.size(1) <= NUM_MAX_TOPK
            and topk_idx.is_contiguous()
        ):
            # The hot path (a layout per MoE layer and step): a well-formed call on the current stream goes straight
            # to the kernel (its entries' range needs no check: the kernel ignores ids outside [0, num_experts)).
            # Anything else takes the general path below, whose checks name what is wrong.
            return (*kernel(topk_idx, num_experts), EventOverlap())
        self._check_num_experts(num_experts)
        self._check_topk_idx(topk_idx, None, num_experts, None, call="get_dispatch_layout")
        self._check_event(previous_event, async_finish, allocate_on_comm_stream)
        result, event = self._run(
            topk_idx.device,
            previous_event,
            async_finish,
            allocate_on_comm_stream,
            [topk_idx],
            lambda: self._backend.get_dispatch_layout(topk_idx, num_experts),
        )
        return (*result, event)

    # ------------------------------------------------------------------ high-throughput dispatch / combine
    def _check_payload(self, name: str, x) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Dispatch payloads: any dtype whose rows are a multiple of 16 bytes (as DeepEP), or a (data, scales) pair."""
        data, scales = split_fp8(name, x)
        if data.dim() != 2:
            raise ValueError(f"{name}: expected shape [num_tokens, hidden], got {list(data.shape)}")
        if data.size(1) * data.element_size() % 16 != 0:
            raise ValueError(
                f"{name}: rows must be a multiple of 16 bytes (hidden * element_size % 16 == 0), "
                f"got hidden={data.size(1)} with {data.dtype}"
            )
        return payload_for_backend(data, scales)

    def _check_config(self, config, default: Callable[[int], Config]) -> Config:
        if config is None:
            return default(self.group_size)
        if not isinstance(config, Config):
            raise TypeError(f"config: expected an ep_dispatcher.Config or None, got {type(config).__name__}")
        return config

    def dispatch(
        self,
        x: FloatPayload,
        handle: Optional[DispatchHandle] = None,
        num_tokens_per_rank: Optional[torch.Tensor] = None,
        num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
        is_token_in_rank: Optional[torch.Tensor] = None,
        num_tokens_per_expert: Optional[torch.Tensor] = None,
        topk_idx: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
        expert_major: bool = False,
    ):
        """Send each token to every rank holding one of its experts.

        Args:
            x: ``[num_tokens, hidden]`` of any dtype whose rows are a multiple of 16 bytes (bfloat16, uint8, ...), or
                a pair ``(data [num_tokens, hidden], scales [num_tokens, num_scales])`` with float32 or int32 (packed
                UE8M0) scales of any column count and any strides (e.g. column-major); rows move as bytes.
            num_tokens_per_expert: ``[num_experts] int32``; with it (even without top-k) the per-expert receive list
                is returned.
            handle: a handle from an earlier dispatch: cached mode, reuses its layout (no count exchange, no host
                sync); as DeepEP, the layout arguments are then ignored and ``topk_idx``/``topk_weights`` must be None.
            num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert: from ``get_dispatch_layout``.
                ``num_tokens_per_rank`` must equal ``is_token_in_rank.sum(0)``; every backend raises ``ValueError``
                naming it otherwise (the CUDA engines find it on the device and raise where the host waits anyway:
                with ``num_worst_tokens``, at a later call).
            num_tokens_per_rdma_rank: accepted for DeepEP compatibility and never read: the internode engine counts
                tokens per node from ``is_token_in_rank``. Checked here (and only here) for dtype, shape
                ``[num_nodes]`` and device when the group spans nodes; ignored otherwise.
            topk_idx ``[num_tokens, num_topk] int64`` / topk_weights ``[num_tokens, num_topk] float32``: optional.
            expert_alignment: each entry of the per-expert count list is rounded up to a multiple of it.
            num_worst_tokens: if > 0, outputs have exactly that many rows and nothing waits on the host (CUDA-graph
                capturable); padding rows have ``recv_topk_idx == -1`` and the count list is empty.
            expert_major: fused permute (an addition over DeepEP; needs ``topk_idx``, not with ``num_worst_tokens``):
                ``recv_x`` is expert-major ``[M, hidden]`` (``M = sum(num_recv_tokens_per_expert_list)``): local
                expert ``e`` owns the ``list[e]`` rows after those of experts ``< e``; in them, each received token that
                picked ``e``, in received order, then zero rows up to ``expert_alignment``. ``recv_topk_idx`` /
                ``recv_topk_weights`` stay in received order ``[num_recv_tokens, num_topk]``; ``handle.expert_major``
                maps both ways (``row_map``: row of each (token, slot); ``row_pair``: (token * num_topk + slot) of each
                row, ``-1`` for padding). ``combine(y, handle)`` then takes an expert-major ``y [M, hidden]``, and a
                cached dispatch with this handle returns expert-major rows. Bit-identical to dispatching normally,
                permuting with ``ep_dispatcher.expert_major.permute_rows`` and un-permuting with ``unpermute_sum``
                before combine (``docs/fused_permute.md``). In cached mode (``handle`` given) the output layout is the
                handle's; ``expert_major=True`` with a received-order handle is an error.
        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``:
            ``recv_x`` in the form of ``x``, rows grouped by source rank ascending, source order kept;
            ``recv_topk_idx`` holds local expert ids (``-1`` for experts elsewhere, whose weight is 0). The counts
            also live on the device as ``handle.num_recv_tokens_per_expert``. Cached mode returns ``None`` for the
            top-k outputs, the list and the handle (as DeepEP: keep the handle you passed).
        """
        data, scales = self._check_payload("x", x)
        num_tokens = data.size(0)
        config = self._check_config(config, Buffer.get_dispatch_config)
        self._check_event(previous_event, async_finish, allocate_on_comm_stream)
        device = data.device
        wrap = (lambda d, s: (d, s)) if scales is not None else (lambda d, s: d)

        if not isinstance(expert_major, bool):
            raise TypeError(f"expert_major: expected a bool, got {type(expert_major).__name__}")
        if handle is not None:
            self._check_handle(handle, DispatchHandle)
            if expert_major and handle.expert_major is None:
                raise ValueError(
                    "expert_major: the handle comes from a received-order dispatch; a cached dispatch returns the "
                    "handle's layout, so pass expert_major=False or a handle from dispatch(..., expert_major=True)"
                )
            # As DeepEP: the layout arguments are ignored in cached mode (the handle holds the layout); top-k
            # arguments cannot be cached (DeepEP asserts they are None).
            for name, value in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
                if value is not None:
                    raise ValueError(
                        f"{name}: must be None in cached mode (handle given); the top-k ids and weights are received "
                        "by the first (non-cached) dispatch only"
                    )
            if num_tokens != handle.num_tokens:
                raise ValueError(f"x: the handle was made for {handle.num_tokens} tokens, got {num_tokens}")
            cached = (
                self._backend.cached_dispatch
                if handle.expert_major is None
                else self._backend.cached_dispatch_expert_major
            )
            (recv, recv_scales), event = self._run(
                device,
                previous_event,
                async_finish,
                allocate_on_comm_stream,
                [data, scales],
                lambda: cached(data, scales, handle, config=config),
            )
            return wrap(recv, recv_scales), None, None, None, None, event

        if isinstance(topk_idx, torch.Tensor) and topk_idx.dim() >= 1 and topk_idx.size(0) != num_tokens:
            # Checked before is_token_in_rank, which get_dispatch_layout built from topk_idx: name the user's tensors.
            raise ValueError(
                f"x, topk_idx: x has {num_tokens} rows (tokens) but topk_idx has {topk_idx.size(0)}; expected one "
                "topk_idx row per token of x"
            )
        check_tensor(
            "is_token_in_rank", is_token_in_rank, dtypes=torch.bool, shape=(num_tokens, self.group_size), device=device
        )
        check_tensor(
            "num_tokens_per_rank", num_tokens_per_rank, dtypes=torch.int32, shape=(self.group_size,), device=device
        )
        if self.is_internode:
            num_nodes = self.group_size // self.num_ranks_per_node
            check_tensor(
                "num_tokens_per_rdma_rank",
                num_tokens_per_rdma_rank,
                dtypes=torch.int32,
                shape=(num_nodes,),
                device=device,
            )
        check_int("expert_alignment", expert_alignment, minimum=1)
        check_int("num_worst_tokens", num_worst_tokens, minimum=0)
        if (topk_idx is None) != (topk_weights is None):
            missing = "topk_weights" if topk_weights is None else "topk_idx"
            raise ValueError(f"{missing}: expected a tensor (topk_idx and topk_weights go together), got None")
        if topk_idx is not None and num_tokens_per_expert is None:
            raise ValueError(
                "num_tokens_per_expert: expected the [num_experts] int32 tensor from get_dispatch_layout with "
                "topk_idx (it gives the number of experts), got None"
            )
        num_experts = None
        if num_tokens_per_expert is not None:
            # Without top-k (DeepEP allows it) the per-expert receive list still comes from these counts.
            check_tensor(
                "num_tokens_per_expert", num_tokens_per_expert, dtypes=torch.int32, shape=(None,), device=device
            )
            num_experts = self._check_num_experts(num_tokens_per_expert.size(0))
        if topk_idx is not None:
            self._check_topk_idx(topk_idx, num_tokens, num_experts, device, call="dispatch")
            check_tensor("topk_weights", topk_weights, dtypes=torch.float32, shape=tuple(topk_idx.shape), device=device)
        if expert_major:
            if topk_idx is None:
                raise ValueError(
                    "expert_major: needs topk_idx and topk_weights (the rows are placed by expert), got None"
                )
            if num_worst_tokens > 0:
                raise ValueError(
                    f"expert_major: not available with num_worst_tokens={num_worst_tokens} (the expert-major row count "
                    "comes from the host count list); pass num_worst_tokens=0"
                )
        args = DispatchArgs(
            x=data,
            x_scales=scales,
            is_token_in_rank=is_token_in_rank,
            num_tokens_per_rank=num_tokens_per_rank,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            num_experts=num_experts,
            expert_alignment=expert_alignment,
            num_worst_tokens=num_worst_tokens,
            buffer_id=self.buffer_id,
            config=config,
            num_tokens_per_expert=num_tokens_per_expert,
        )
        fresh = self._backend.dispatch_expert_major if expert_major else self._backend.dispatch
        result, event = self._run(
            device,
            previous_event,
            async_finish,
            allocate_on_comm_stream,
            [data, scales, is_token_in_rank, num_tokens_per_rank, topk_idx, topk_weights],
            lambda: fresh(args),
        )
        recv, recv_scales, recv_topk_idx, recv_topk_weights, per_expert_list, new_handle = result
        return wrap(recv, recv_scales), recv_topk_idx, recv_topk_weights, per_expert_list, new_handle, event

    # DeepEP's internode_dispatch takes dispatch's arguments in this order, without num_worst_tokens.
    _INTERNODE_DISPATCH_ARGS = (
        "x",
        "handle",
        "num_tokens_per_rank",
        "num_tokens_per_rdma_rank",
        "is_token_in_rank",
        "num_tokens_per_expert",
        "topk_idx",
        "topk_weights",
        "expert_alignment",
        "config",
        "previous_event",
        "async_finish",
        "allocate_on_comm_stream",
    )

    def internode_dispatch(self, *args, **kwargs):
        """DeepEP's internal ``internode_dispatch`` (its positional order, no ``num_worst_tokens``): ``dispatch``."""
        if len(args) > len(self._INTERNODE_DISPATCH_ARGS):
            raise TypeError(f"internode_dispatch: at most {len(self._INTERNODE_DISPATCH_ARGS)} positional arguments")
        kwargs.update(zip(self._INTERNODE_DISPATCH_ARGS, args))
        return self.dispatch(**kwargs)

    def internode_combine(
        self,
        x,
        handle,
        topk_weights=None,
        bias=None,
        config=None,
        previous_event=None,
        async_finish=False,
        allocate_on_comm_stream=False,
    ):
        """DeepEP's internal ``internode_combine``: ``combine``."""
        return self.combine(
            x, handle, topk_weights, bias, config, previous_event, async_finish, allocate_on_comm_stream
        )

    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: Optional[torch.Tensor] = None,
        bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
        config: Optional[Config] = None,
        previous_event: Optional[EventOverlap] = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        """Send each received row back to its source rank, which sums them (unweighted).

        Args:
            x: ``[handle.num_recv_rows, hidden]`` (the dispatch's ``recv_x`` rows, expert outputs already weighted);
                with a handle of ``dispatch(..., expert_major=True)``, expert-major ``[handle.expert_major.num_rows,
                hidden]``: each received token's rows are first summed in row (= local expert) order, fp32, one
                rounding to ``x.dtype`` (padding rows are not read), then combined as below (fused un-permute).
            handle: from the dispatch.
            topk_weights: optional ``[num_recv_rows, num_topk] float32`` (received order in both layouts), summed
                back too (rebuilds the original weights; dispatch's backward).
            bias: optional ``[num_tokens, hidden]`` tensor or pair of them, added to the sum.
        Returns:
            ``(combined_x [num_tokens, hidden] x.dtype, combined_topk_weights [num_tokens, num_topk] float32 or None,
            event)``. Summation (deterministic, fp32; fp64 for fp64 input): within one node, ``0 + bias_0 + bias_1``,
            then each rank's row in rank order, one rounding at the end. When the group spans several nodes
            (``num_ranks > num_ranks_per_node``): first per node, ``0 + rows of that node's ranks`` in rank order,
            rounded to ``x.dtype`` (what crosses the RDMA leg); then ``0 + bias_0 + bias_1 + node partials`` in node
            order, one rounding at the end. Ranks and nodes that did not receive the token are skipped. The top-k
            weights follow the same orders (fp32, no rounding).
        """
        self._check_handle(handle, DispatchHandle)
        rows = handle.num_recv_rows
        layout = handle.expert_major
        check_tensor(
            "x", x, dtypes=self._backend.float_dtypes, shape=(rows if layout is None else layout.num_rows, None)
        )
        if x.size(1) * x.element_size() % 16 != 0:
            raise ValueError(f"x: rows must be a multiple of 16 bytes, got hidden={x.size(1)} with {x.dtype}")
        config = self._check_config(config, Buffer.get_combine_config)
        self._check_event(previous_event, async_finish, allocate_on_comm_stream)
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, dtypes=torch.float32, shape=(rows, None), device=x.device)
        biases: List[torch.Tensor] = []
        if bias is not None:
            biases = list(bias) if isinstance(bias, (tuple, list)) else [bias]
            if len(biases) > 2:
                raise ValueError(f"bias: expected a tensor or a pair of tensors, got {len(biases)} tensors")
            for i, b in enumerate(biases):
                check_tensor(
                    f"bias[{i}]" if isinstance(bias, (tuple, list)) else "bias",
                    b,
                    dtypes=x.dtype,
                    shape=(handle.num_tokens, x.size(1)),
                    device=x.device,
                )
        combine = self._backend.combine if layout is None else self._backend.combine_expert_major
        (combined, combined_w), event = self._run(
            x.device,
            previous_event,
            async_finish,
            allocate_on_comm_stream,
            [x, topk_weights, *biases],
            lambda: combine(CombineArgs(x, handle, topk_weights, tuple(biases), config)),
        )
        return combined, combined_w, event

    # ------------------------------------------------------------------ low latency
    def _check_low_latency(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        if not self.low_latency_mode:
            raise RuntimeError("low-latency calls need Buffer(..., low_latency_mode=True, num_rdma_bytes=...)")
        shape = (num_max_dispatch_tokens_per_rank, hidden, num_experts)
        if shape in self._ll.sized_shapes:  # checked before: the size hint is Python arithmetic worth skipping per call
            return
        check_int("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank, minimum=1)
        self._check_num_experts(num_experts)
        if hidden % 128 != 0:
            raise ValueError(f"x: low-latency kernels need hidden % 128 == 0, got hidden={hidden}")
        need = Buffer.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank, hidden, self.group_size, num_experts
        )
        if self.num_rdma_bytes < need:
            raise ValueError(
                f"num_rdma_bytes: low-latency calls with num_max_dispatch_tokens_per_rank="
                f"{num_max_dispatch_tokens_per_rank}, hidden={hidden}, num_experts={num_experts} need at "
                f"least {need} bytes (Buffer.get_low_latency_rdma_size_hint), but the Buffer was created "
                f"with num_rdma_bytes={self.num_rdma_bytes}"
            )
        self._ll.sized_shapes.add(shape)

    @property
    def num_pending_low_latency_hooks(self) -> int:
        """Low-latency calls whose hook has not run yet (at most ``NUM_LOW_LATENCY_BUFFERS``)."""
        return self._ll.num_pending

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
        dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ):
        """Decode-time dispatch into fixed expert-major buffers (no host sync).

        Args:
            x: ``[num_tokens, hidden] bfloat16``, ``num_tokens <= num_max_dispatch_tokens_per_rank``, hidden % 128 == 0.
            topk_idx: ``[num_tokens, num_topk] int64``, ``-1`` = no expert, distinct experts per token. The CUDA
                kernels check the entries on the GPU (no host sync), skip bad ones and raise ``ValueError`` from the
                hook or a later low-latency call (docs/low_latency.md).
            use_fp8: cast to FP8 in the kernel (per-128-channel scales ``amax / 448``); ``round_scale`` rounds the
                scales up to powers of two; ``use_ue8m0`` (needs ``round_scale``, hidden % 512 == 0) packs them as
                8-bit exponents, four per int32.
            return_recv_hook: launch only the send phase and return ``hook``; ``hook()`` runs the receive phase.
            cumulative_local_expert_recv_stats: optional ``[num_local_experts] int32``, incremented by ``recv_count``.
            dispatch_wait_recv_cost_stats: optional ``[num_ranks] int64`` (DeepEP's check; its docstring says
                ``[num_ranks, num_ranks]``): time the receive phase spent waiting for each source rank's data,
                accumulated (``stats[r] +=``), as DeepEP. The CUDA engine adds the SM clock cycles (``clock64``) its
                receive kernel spun on each (local expert, source rank) count, one add per count, in the receive
                kernel itself (no extra kernel, no host sync; captured in CUDA graphs; with ``return_recv_hook`` the
                hook's kernel adds them). The reference backend adds 0 to every rank: it receives through a blocking
                collective, which exposes no per-peer wait to measure.
        Returns:
            ``(recv_x, recv_count, handle, event, hook)``: ``recv_x`` is ``[E_local, num_ranks * max_tokens, hidden]``
            bf16, or with FP8 a pair ``(float8 data, scales)`` where scales are ``[E_local, num_ranks * max_tokens,
            hidden / 128] float32`` (``hidden / 512`` int32 with UE8M0) stored token-minor (a transposed view, as
            grouped GEMMs want); ``recv_count [E_local] int32``. Expert ``e`` holds ``recv_count[e]`` tokens in its
            first slots, grouped by source rank ascending, token order kept (deterministic).
        """
        self._check_alive()
        check_tensor("x", x, dtypes=torch.bfloat16)
        if x.dim() != 2:
            raise ValueError(f"x: expected shape [num_tokens, hidden], got {list(x.shape)}")
        num_tokens, hidden = x.shape
        self._check_low_latency(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        if num_tokens > num_max_dispatch_tokens_per_rank:
            raise ValueError(
                f"x: {num_tokens} tokens exceed num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}"
            )
        self._check_topk_idx(
            topk_idx,
            num_tokens,
            num_experts,
            x.device,
            distinct=True,
            call="low_latency",
        )
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0: needs round_scale=True (UE8M0 stores power-of-two scales only)")
        if use_ue8m0 and hidden % 512 != 0:
            raise ValueError(f"use_ue8m0: needs hidden % 512 == 0 (four scales per int32), got hidden={hidden}")
        if use_ue8m0 and not use_fp8:
            raise ValueError("use_ue8m0: needs use_fp8=True")
        num_local_experts = num_experts // self.group_size
        if cumulative_local_expert_recv_stats is not None:
            check_tensor(
                "cumulative_local_expert_recv_stats",
                cumulative_local_expert_recv_stats,
                dtypes=torch.int32,
                shape=(num_local_experts,),
                device=x.device,
            )
        self._check_wait_cost_stats("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, x.device)
        self._ll.enter_shape((num_max_dispatch_tokens_per_rank, hidden, num_experts))
        half = self._ll.take_half()

        # The backend allocates the outputs: the CUDA engine in the C++ call that launches the send phase (cheaper than
        # torch.empty from Python), the reference with allocate_dispatch_outputs; receive() fills them.
        handle, (recv_data, recv_scales, recv_count), receive = self._backend.low_latency_dispatch(
            LowLatencyDispatchArgs(
                x,
                topk_idx,
                num_max_dispatch_tokens_per_rank,
                num_experts,
                use_fp8,
                round_scale,
                use_ue8m0,
                self.buffer_id,
                half,
                cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats,
                receive_now=not return_recv_hook,
            )
        )
        hook = self._ll.make_hook(receive, return_recv_hook, half, handle)
        self._ll.raise_reported_error(hook)
        event = Buffer.capture() if async_finish and x.is_cuda else EventOverlap()
        recv_x = (recv_data, recv_scales) if use_fp8 else recv_data
        return recv_x, recv_count, handle, event, hook

    def _check_wait_cost_stats(self, name: str, stats: Optional[torch.Tensor], device: torch.device) -> None:
        if stats is not None:
            check_tensor(name, stats, dtypes=torch.int64, shape=(self.group_size,), device=device)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The ``[E_local, num_ranks * max_tokens, hidden] bfloat16`` buffer the next ``low_latency_combine`` reads
        when ``zero_copy=True``: write the expert outputs there to skip one copy."""
        self._check_alive()
        self._check_handle(handle, LowLatencyHandle)
        shape = (
            handle.num_experts // self.group_size,
            self.group_size * handle.num_max_dispatch_tokens_per_rank,
            handle.hidden,
        )
        return self._backend.low_latency_combine_buffer(self._ll.next_half, shape, handle.src_info.device)

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: Optional[torch.Tensor] = None,
        combine_wait_recv_cost_stats: Optional[torch.Tensor] = None,
    ):
        """Bring expert outputs back and reduce them: ``out[t] = sum_k w[t, k] * y[t, k]`` in fp32, k ascending.

        Args:
            x: ``[E_local, num_ranks * max_tokens, hidden] bfloat16`` expert outputs in the dispatch's layout. With
                ``zero_copy=True`` (as DeepEP) the data is taken from ``get_next_low_latency_combine_buffer(handle)``,
                which the caller filled; ``x`` is then not read (only its shape and dtype are checked).
            topk_idx, topk_weights: the dispatch's ``[num_tokens, num_topk]`` ids (int64) and weights (float32).
            handle: the dispatch's handle (or the 5-tuple view of it).
            use_logfmt: send the expert outputs in DeepEP's LogFMT-10 format (``ep_dispatcher.logfmt``): each
                128-channel group below 1 in magnitude is rounded to the format before the sum.
            out: optional ``[num_tokens, hidden] bfloat16`` destination.
            combine_wait_recv_cost_stats: optional ``[num_ranks] int64``, accumulated as in ``low_latency_dispatch``:
                the CUDA engine adds the ``clock64`` cycles its receive kernel spun on each expert's flag to the rank
                that holds the expert (one add per expert); the reference backend adds 0.
        Returns:
            ``(combined_x [num_tokens, hidden] bfloat16, event, hook)``.
        """
        self._check_alive()
        self._check_handle(handle, LowLatencyHandle)
        num_local_experts = handle.num_experts // self.group_size
        num_slots = self.group_size * handle.num_max_dispatch_tokens_per_rank
        expected_shape = (num_local_experts, num_slots, handle.hidden)
        check_tensor("x", x, dtypes=torch.bfloat16, shape=expected_shape, contiguous=not zero_copy)
        self._check_low_latency(handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
        if not self._ll.is_received(handle):
            raise RuntimeError(
                "handle: the receive hook of the low_latency_dispatch that made it has not run; call that hook() "
                "before low_latency_combine (the handle's layout is filled by the receive phase)"
            )
        if zero_copy:
            x = self._backend.low_latency_combine_buffer(self._ll.next_half, expected_shape, handle.src_info.device)
        device = x.device
        self._check_topk_idx(topk_idx, handle.num_tokens, handle.num_experts, device, call="low_latency")
        shape = (handle.num_tokens, handle.num_topk)
        if topk_idx.shape != shape:
            raise ValueError(f"topk_idx: expected shape {list(shape)} (as dispatched), got {list(topk_idx.shape)}")
        check_tensor("topk_weights", topk_weights, dtypes=torch.float32, shape=shape, device=device)
        self._check_wait_cost_stats("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, device)
        if out is not None:
            check_tensor("out", out, dtypes=torch.bfloat16, shape=(handle.num_tokens, handle.hidden), device=device)
        if use_logfmt:
            # An extra pass over the expert outputs before the combine kernel (in place on the zero-copy buffer,
            # which is ours); a fused encode in the send kernel would save it.
            x = self._backend.logfmt_roundtrip(x, inplace=zero_copy)
        self._ll.enter_shape((handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts))
        half = self._ll.take_half()
        # Without `out`, the backend allocates it (the CUDA engine in the C++ call that launches the send phase).
        out, receive = self._backend.low_latency_combine(
            LowLatencyCombineArgs(
                x,
                topk_idx,
                topk_weights,
                handle,
                half,
                combine_wait_recv_cost_stats,
                out,
                receive_now=not return_recv_hook,
            )
        )
        hook = self._ll.make_hook(receive, return_recv_hook, half)
        self._ll.raise_reported_error(hook)
        event = Buffer.capture() if async_finish and x.is_cuda else EventOverlap()
        return out, event, hook

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset the low-latency buffer's signal area (needed after high-throughput use of the same memory)."""
        self._check_alive()
        self._check_low_latency(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        if self.num_pending_low_latency_hooks:
            raise RuntimeError(
                f"clean_low_latency_buffer: {self.num_pending_low_latency_hooks} low-latency hook(s) have not run; "
                "cleaning would erase the data they are to receive. Run them first"
            )
        self._ll.shape = (num_max_dispatch_tokens_per_rank, hidden, num_experts)
        clean = getattr(self._backend, "clean_low_latency_buffer", None)
        if clean is not None:
            clean(num_max_dispatch_tokens_per_rank, hidden, num_experts)
