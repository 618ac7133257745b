"""ep_dispatcher: expert-parallel dispatch/combine for Mixture-of-Experts (DeepEP-compatible API).

from ep_dispatcher import Buffer, Config, EventOverlap

DeepEP programs run unchanged after ``ep_dispatcher.install_as_deep_ep()`` (``import deep_ep`` then resolves here;
see docs/deepep_compat.md).
"""

from . import utils
from .buffer import Buffer
from .compat import install_as_deep_ep
from .config import Config
from .fp8 import per_token_cast_back, per_token_cast_to_fp8
from .handles import DispatchHandle, LowLatencyHandle
from .overlap import EventHandle, EventOverlap

__version__ = "0.1.0"

__all__ = [
    "Buffer",
    "Config",
    "DispatchHandle",
    "EventHandle",
    "EventOverlap",
    "LowLatencyHandle",
    "install_as_deep_ep",
    "per_token_cast_back",
    "per_token_cast_to_fp8",
    "utils",
    "__version__",
]
