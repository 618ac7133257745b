"""ep_dispatcher: expert-parallel dispatch/combine for Mixture-of-Experts (DeepEP-compatible API).

from ep_dispatcher import Buffer, Config, EventOverlap
"""

from .buffer import Buffer
from .config import Config
from .fp8 import per_token_cast_back, per_token_cast_to_fp8
from .handles import DispatchHandle, LowLatencyHandle
from .overlap import EventOverlap

__version__ = "0.1.0"

__all__ = [
    "Buffer",
    "Config",
    "DispatchHandle",
    "EventOverlap",
    "LowLatencyHandle",
    "per_token_cast_back",
    "per_token_cast_to_fp8",
    "__version__",
]
