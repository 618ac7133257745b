"""Kernel configuration (SMs, chunk sizes) and the buffer sizes it implies.

The names and positional order follow DeepEP's ``Config`` so that code written for it works unchanged:
``Config(num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens)``.
Tuned values per (GPU, number of ranks) live in ``configs/*.json`` and are read by :func:`load_tuned_config`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from . import settings
from pathlib import Path

NUM_MAX_TOPK = 16  # widest top-k the engine's per-token metadata slot holds (DeepSeek-V3 uses 8)
FP8_GROUP_SIZE = 128  # channels per FP8 scale
BUFFER_ALIGNMENT = 128  # every region of the registered buffer starts on a 128-byte boundary (TMA, 16-B vectors)
DEFAULT_RANKS_PER_NODE = settings.DEFAULT_RANKS_PER_NODE  # GPUs of one NVLink domain unless told otherwise
DEFAULT_MAX_TOKENS_PER_RANK = 4096  # internode buffer sizing default: the training/prefill shape of DESIGN.md
INTERNODE_MAX_LOCAL_EXPERTS = 1024  # experts per rank a count slot of the internode engine holds
NUM_LOW_LATENCY_BUFFERS = 2  # LL calls alternate between two halves, so one call's output survives the next call


def _align(value: int, alignment: int = BUFFER_ALIGNMENT) -> int:
    return (value + alignment - 1) // alignment * alignment


def per_token_bytes(hidden_bytes: int) -> int:
    """Bytes of one token's row with every field (payload, worst-case FP8 scales, top-k ids/weights, source index):
    the unit of DeepEP's ring-queue hint and of the intranode engine's receive-pool hint."""
    hidden = hidden_bytes // 2  # hint callers pass hidden * max(element_size, 2): BF16 sizing covers FP8 too
    scale_bytes = (hidden + FP8_GROUP_SIZE - 1) // FP8_GROUP_SIZE * 4
    topk_bytes = NUM_MAX_TOPK * (8 + 4)  # int64 ids + fp32 weights
    return _align(hidden_bytes + scale_bytes + topk_bytes + 4, 16)


@dataclass(frozen=True)
class Config:
    """Launch configuration of one high-throughput call.

    num_sms: the most SMs (thread blocks) a data kernel of the call occupies; any positive count (DeepEP demands an
        even one, one sender and one receiver block per channel: ours has no channels).
    num_max_*_chunked_send_tokens, num_max_*_chunked_recv_tokens: DeepEP's ring-queue parameters (tokens a sender
        pushes before publishing its tail; ring depth per channel and peer). Accepted and checked as DeepEP does, so
        DeepEP code and its tuned tables run unchanged, but our engines have no ring: they only feed the DeepEP-sized
        ``get_nvl_buffer_size_hint`` / ``get_rdma_buffer_size_hint`` (without ``num_max_tokens_per_rank``).
    """

    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self) -> None:
        for name in (
            "num_sms",
            "num_max_nvl_chunked_send_tokens",
            "num_max_nvl_chunked_recv_tokens",
            "num_max_rdma_chunked_send_tokens",
            "num_max_rdma_chunked_recv_tokens",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Config.{name}: expected a positive int, got {value!r}")
        if self.num_max_nvl_chunked_send_tokens > self.num_max_nvl_chunked_recv_tokens:
            raise ValueError(
                "Config.num_max_nvl_chunked_send_tokens: expected <= num_max_nvl_chunked_recv_tokens "
                f"({self.num_max_nvl_chunked_recv_tokens}), got {self.num_max_nvl_chunked_send_tokens}"
            )
        if self.num_max_rdma_chunked_send_tokens > self.num_max_rdma_chunked_recv_tokens:
            raise ValueError(
                "Config.num_max_rdma_chunked_send_tokens: expected <= num_max_rdma_chunked_recv_tokens "
                f"({self.num_max_rdma_chunked_recv_tokens}), got {self.num_max_rdma_chunked_send_tokens}"
            )

    @property
    def num_channels(self) -> int:
        """DeepEP's channel count for this SM count (its ring-queue sizes scale with it)."""
        return max(1, self.num_sms // 2)

    def get_nvl_buffer_size_hint(
        self, hidden_bytes: int, num_ranks: int, num_max_tokens_per_rank: Optional[int] = None
    ) -> int:
        """Bytes of NVLink buffer a rank needs for this config: ``hidden_bytes = hidden * max(element_size, 2)``.

        Without ``num_max_tokens_per_rank`` this is DeepEP's ring-queue size (for code sized the DeepEP way; nothing
        enforces it). The CUDA intranode engine receives every row straight into its receive pool, so it needs room
        for all rows a rank can receive: pass ``num_max_tokens_per_rank`` (the most tokens any rank passes to one
        call) to get a size that also holds the worst case, every rank's tokens routed to one rank.
        """
        _check_hint_args(hidden_bytes, num_ranks)
        nvl_peers = min(num_ranks, DEFAULT_RANKS_PER_NODE)
        ring = self.num_channels * nvl_peers * self.num_max_nvl_chunked_recv_tokens * per_token_bytes(hidden_bytes)
        counters = self.num_channels * nvl_peers * 4 * 4  # head, tail, start, end (int32) per (channel, peer)
        prefix_matrices = num_ranks * num_ranks * 4 + 2 * num_ranks * self.num_channels * 4
        ring_hint = _align(ring) + _align(counters) + _align(prefix_matrices)
        if num_max_tokens_per_rank is None:
            return ring_hint
        tokens = num_max_tokens_per_rank
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise ValueError(f"num_max_tokens_per_rank: expected a non-negative int, got {tokens!r}")
        # The engine's regions (x, scales, top-k ids, weights, source index), each padded to BUFFER_ALIGNMENT.
        engine = _align(nvl_peers * tokens * per_token_bytes(hidden_bytes)) + 8 * BUFFER_ALIGNMENT
        return max(ring_hint, engine)

    def get_rdma_buffer_size_hint(
        self,
        hidden_bytes: int,
        num_ranks: int,
        num_ranks_per_node: Optional[int] = None,
        num_max_tokens_per_rank: Optional[int] = None,
    ) -> int:
        """Bytes of NVSHMEM buffer a rank needs for internode dispatch/combine (0 when all ranks share a node).

        ``hidden_bytes = hidden * max(element_size, 2)``; ``num_ranks_per_node`` defaults to Buffer's default (env
        ``EP_DISPATCHER_RANKS_PER_NODE``, else 8),
        ``num_max_tokens_per_rank`` (tokens any rank passes to one call) to 4096. The internode engine is sized for
        the worst case (every token of every rank routed to one rank), not from this config's chunk sizes; the
        arithmetic is csrc/kernels/internode.cu's ``make_layout`` (:func:`internode_layout_bytes`).

        Larger than DeepEP's hint on purpose (issue 20): 7.0x at 16 and 64 ranks with the default Config and hidden
        7168 (14x against DeepEP's configs with 128 RDMA receive tokens). DeepEP streams rows through per-channel ring
        queues, so its size follows the chunk sizes; our engine writes each row straight to its final place, so it
        needs room for every row a call can bring (``R * T`` at the receiver). A buffer of DeepEP's default hint holds
        582 tokens per rank of hidden 7168; a call with more raises ``ValueError`` naming ``num_rdma_bytes``.
        """
        _check_hint_args(hidden_bytes, num_ranks)
        # The default follows Buffer's: env EP_DISPATCHER_RANKS_PER_NODE, else 8.
        per_node = default_ranks_per_node() if num_ranks_per_node is None else num_ranks_per_node
        if not isinstance(per_node, int) or isinstance(per_node, bool) or per_node <= 0:
            raise ValueError(f"num_ranks_per_node: expected a positive int, got {num_ranks_per_node!r}")
        if num_ranks <= per_node:
            return 0
        if num_ranks % per_node != 0:
            raise ValueError(f"num_ranks: expected a multiple of num_ranks_per_node={per_node}, got {num_ranks}")
        tokens = DEFAULT_MAX_TOKENS_PER_RANK if num_max_tokens_per_rank is None else num_max_tokens_per_rank
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise ValueError(f"num_max_tokens_per_rank: expected a non-negative int, got {num_max_tokens_per_rank!r}")
        return internode_layout_bytes(hidden_bytes, num_ranks, per_node, tokens)


def default_ranks_per_node() -> int:
    """Ranks per node when none is given: env ``EP_DISPATCHER_RANKS_PER_NODE``, else 8 (also Buffer's default)."""
    return settings.ranks_per_node()


def internode_layout_bytes(hidden_bytes: int, num_ranks: int, num_ranks_per_node: int, max_tokens: int) -> int:
    """Bytes of the internode engine's symmetric buffer for ``max_tokens`` tokens per rank: the kernels' own layout
    (``_C.internode_layout``, csrc/kernels/internode.cu ``make_layout``) where the extension is built, else the
    reference backend's copy of its arithmetic (``backends/reference_layout.py``)."""
    ext = _extension()
    if ext is None:
        from .backends import reference_layout

        return reference_layout.internode_layout_bytes(hidden_bytes, num_ranks, num_ranks_per_node, max_tokens)
    return ext.internode_layout(hidden_bytes, num_ranks, num_ranks_per_node, max_tokens).total_bytes


@lru_cache(maxsize=None)
def _extension():
    """``ep_dispatcher._C`` if it is built (then the one source of the engines' buffer sizes), else None."""
    try:
        from . import _C
    except ImportError:
        return None
    return _C


def _check_hint_args(hidden_bytes: int, num_ranks: int) -> None:
    if not isinstance(hidden_bytes, int) or hidden_bytes <= 0 or hidden_bytes % 16 != 0:
        raise ValueError(
            f"hidden_bytes: expected a positive multiple of 16 (hidden * max(element_size, 2)), got {hidden_bytes!r}"
        )
    if not isinstance(num_ranks, int) or num_ranks <= 0:
        raise ValueError(f"num_ranks: expected a positive int, got {num_ranks!r}")


def get_low_latency_rdma_size_hint(
    num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
) -> int:
    """NVSHMEM bytes per rank for low-latency mode (both halves of the double buffer): the kernels' own layout
    (``_C.low_latency_layout``, csrc/kernels/low_latency.cu ``make_layout``) where the extension is built, else the
    reference backend's copy of its arithmetic (``backends/reference_layout.py``)."""
    for name, value in (
        ("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
        ("hidden", hidden),
        ("num_ranks", num_ranks),
        ("num_experts", num_experts),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if hidden % FP8_GROUP_SIZE != 0:
        raise ValueError(f"hidden: low-latency kernels need hidden % {FP8_GROUP_SIZE} == 0, got {hidden}")
    ext = _extension()
    if ext is None:
        from .backends import reference_layout

        tokens = num_max_dispatch_tokens_per_rank
        return reference_layout.low_latency_layout_bytes(tokens, hidden, num_ranks, num_experts)
    return ext.low_latency_layout(num_ranks, num_experts, num_max_dispatch_tokens_per_rank, hidden).total_bytes


def _config_dirs() -> list[Path]:
    dirs = []
    if settings.config_dir():
        dirs.append(Path(settings.config_dir()))
    dirs.append(Path(__file__).resolve().parent.parent / "configs")  # source checkout / editable install
    try:
        from importlib.resources import files

        dirs.append(Path(str(files("ep_dispatcher.configs"))))  # installed wheel
    except (ImportError, ModuleNotFoundError, TypeError):
        pass
    return dirs


@lru_cache(maxsize=None)
def _load_config_table(gpu_name: str) -> dict:
    """The tuned table for ``gpu_name`` ('h200', ...) falling back to ``default.json``."""
    for directory in _config_dirs():
        for stem in (gpu_name, "default"):
            path = directory / f"{stem}.json"
            if stem and path.is_file():
                with open(path) as f:
                    return json.load(f)
    return {}


def gpu_config_name() -> str:
    """Short lower-case GPU name used to pick a tuned table ('h200', 'h100', ...), '' without a GPU."""
    try:
        import torch

        if torch.cuda.is_available():
            return _short_gpu_name(torch.cuda.current_device())
    except Exception:  # pragma: no cover - any driver trouble means "no tuned table"
        pass
    return ""


@lru_cache(maxsize=None)
def _short_gpu_name(device: int) -> str:
    """Cached per device: every dispatch/combine without a config asks, and a device-properties query is not free."""
    import torch

    name = torch.cuda.get_device_name(device).lower()
    # Where one name contains another, the longer comes first ("h200" before "h20", "gb200" before "b200").
    for short in ("h200", "h100", "h800", "h20", "gb200", "b200", "a100"):
        if short in name:
            return short
    return ""


def recommended_num_sms(kind: str, num_ranks: int) -> Optional[int]:
    """SM count ``benchmarks/bench_intranode.py --tune-sms`` measured as best for ``kind`` and ``num_ranks`` on this
    GPU (``configs/<gpu>.json``), or None when that table has none. Use it with ``Buffer.set_num_sms``."""
    if kind not in ("dispatch", "combine"):
        raise ValueError(f"kind: expected 'dispatch' or 'combine', got {kind!r}")
    value = _load_config_table(gpu_config_name()).get("num_sms", {}).get(kind, {}).get(str(num_ranks))
    return None if value is None else int(value)


def load_tuned_config(kind: str, num_ranks: int, num_sms: int) -> Config:
    """Tuned ``Config`` for ``kind`` ('dispatch' or 'combine') and ``num_ranks``; ``num_sms`` overrides the SMs."""
    if kind not in ("dispatch", "combine"):
        raise ValueError(f"kind: expected 'dispatch' or 'combine', got {kind!r}")
    if not isinstance(num_ranks, int) or num_ranks <= 0:
        raise ValueError(f"num_ranks: expected a positive int, got {num_ranks!r}")
    table = _load_config_table(gpu_config_name())
    entries = table.get(kind, {})
    # Exact rank count, else the next larger tuned count (deeper rings are safe), else the largest one.
    keys = sorted(int(k) for k in entries)
    chosen = next((k for k in keys if k >= num_ranks), keys[-1] if keys else None)
    values = dict(entries[str(chosen)]) if chosen is not None else {}
    values["num_sms"] = num_sms
    return Config(**values)
