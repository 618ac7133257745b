"""DeepEP's ``deep_ep.utils``: ``EventOverlap``, ``EventHandle`` and ``check_nvlink_connections``.

Megatron-core's ``fused_a2a.py`` does ``from deep_ep.utils import EventHandle, EventOverlap`` and builds
``EventOverlap(EventHandle())``; after ``ep_dispatcher.install_as_deep_ep()`` this module is ``deep_ep.utils``.
"""

from __future__ import annotations

from .compat import check_nvlink_connections
from .config import Config
from .overlap import EventHandle, EventOverlap

__all__ = ["Config", "EventHandle", "EventOverlap", "check_nvlink_connections"]
