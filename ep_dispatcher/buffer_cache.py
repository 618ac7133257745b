"""One ``Buffer`` per process group for a framework plugin, created on first use and grown when a layer needs more.

Every MoE layer of a model dispatches over the same expert-parallel group, so the layers share one buffer (as
DeepEP's framework integrations do); it is re-created only when a wider row, more tokens or a different group shows
up. The Megatron and DeepSpeed plugins each keep one :class:`BufferCache`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Dict, Optional, Tuple

import torch.distributed as dist

from .buffer import Buffer
from . import settings
from .config import default_ranks_per_node, gpu_config_name, load_tuned_config

MIN_TOKENS = 1024  # token counts are rounded up to a power of two from here, so a small change does not re-create


def required_bytes(hidden_bytes: int, num_ranks: int, num_tokens: int) -> Tuple[int, int]:
    """``(num_nvl_bytes, num_rdma_bytes)`` for dispatch and combine of up to ``num_tokens`` rows per rank of
    ``hidden_bytes`` (``hidden * max(element_size, 2)``), including the CUDA intranode engine's worst case."""
    # Asked on every layer's forward (~20 µs unmemoised): memoised on everything the sizes depend on (the tuned
    # tables themselves are read once per process, see config._load_config_table).
    key = (default_ranks_per_node(), Buffer.num_sms, gpu_config_name())
    return _required_bytes(hidden_bytes, num_ranks, num_tokens, *key)


@lru_cache(maxsize=None)
def _required_bytes(
    hidden_bytes: int, num_ranks: int, num_tokens: int, per_node: int, num_sms: int, gpu: str
) -> Tuple[int, int]:
    # `gpu` is only part of the key: load_tuned_config picks the same table from the current device.
    configs = tuple(load_tuned_config(kind, num_ranks, num_sms) for kind in ("dispatch", "combine"))
    nvl = max(c.get_nvl_buffer_size_hint(hidden_bytes, num_ranks, num_tokens) for c in configs)
    rdma = max(c.get_rdma_buffer_size_hint(hidden_bytes, num_ranks, per_node, num_tokens) for c in configs)
    return nvl, rdma


def rounded_tokens(num_tokens: int) -> int:
    """The token capacity a buffer is sized for: ``num_tokens`` rounded up to a power of two, at least MIN_TOKENS."""
    tokens = MIN_TOKENS
    while tokens < num_tokens:
        tokens *= 2
    return tokens


class BufferCache:
    """Buffers keyed by process group; ``backend_env`` names the env var that picks their backend."""

    def __init__(self, backend_env: str):
        self.backend_env = backend_env
        self.backend_override: Optional[str] = None
        self.buffers: Dict[int, Buffer] = {}

    def backend(self) -> str:
        """``backend`` of buffers created from now on: the override, else env ``backend_env``, else ``"auto"``."""
        return self.backend_override or settings.plugin_backend(self.backend_env)

    def get(self, group: dist.ProcessGroup, hidden_bytes: int, num_tokens: int) -> Buffer:
        """The cached buffer of ``group``, large enough for ``num_tokens`` rows per rank of ``hidden_bytes``.

        Collective over ``group`` when it creates a buffer: every rank of the group must reach this point with the
        same ``hidden_bytes`` and the same rounded token count (:func:`rounded_tokens`; same model and sequence
        length, as in Megatron and DeepSpeed training), so that they create it together.
        """
        group = group if group is not None else dist.group.WORLD  # as Buffer resolves it
        num_ranks = dist.get_world_size(group)
        nvl, rdma = required_bytes(hidden_bytes, num_ranks, rounded_tokens(num_tokens))
        key = id(group)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.group is not group or buffer.num_nvl_bytes < nvl or buffer.num_rdma_bytes < rdma:
            if buffer is not None and buffer.group is group:
                nvl, rdma = max(nvl, buffer.num_nvl_bytes), max(rdma, buffer.num_rdma_bytes)
            buffer = Buffer(group, num_nvl_bytes=nvl, num_rdma_bytes=rdma, backend=self.backend())
            self.buffers[key] = buffer
        return buffer

    def clear(self) -> None:
        """Forget every cached buffer (tests; or before destroying the process groups)."""
        self.buffers.clear()
