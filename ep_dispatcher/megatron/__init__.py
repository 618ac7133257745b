"""Megatron-core plugin: ``TransformerConfig(moe_token_dispatcher_type="deepep")`` runs MoE dispatch/combine on
``ep_dispatcher``.

    import ep_dispatcher.megatron          # registers "deepep" when megatron-core is importable
    config = TransformerConfig(..., moe_token_dispatcher_type="deepep")

Importing this package installs the plugin if megatron-core can be imported, and does nothing otherwise
(``install()`` then raises ``ImportError``). ``import ep_dispatcher`` alone never imports megatron.
See docs/megatron.md.
"""

from __future__ import annotations

import importlib.util
import warnings

from .install import TYPE_NAME, install, is_installed, megatron_version, uninstall, uses_ep_dispatcher

__all__ = [
    "TYPE_NAME",
    "EPDispatcherTokenDispatcher",
    "install",
    "is_installed",
    "megatron_version",
    "uninstall",
    "uses_ep_dispatcher",
]


def __getattr__(name: str):
    # The dispatcher subclasses Megatron's MoETokenDispatcher, so it is imported only when asked for.
    if name == "EPDispatcherTokenDispatcher":
        from .token_dispatcher import EPDispatcherTokenDispatcher

        return EPDispatcherTokenDispatcher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _megatron_importable() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        return False


if _megatron_importable():
    try:
        install()
    except ImportError as e:  # megatron-core present but not importable (e.g. a missing dependency)
        warnings.warn(
            f"ep_dispatcher.megatron: megatron-core was found but could not be imported, so "
            f"moe_token_dispatcher_type='deepep' is not registered: {e}",
            stacklevel=2,
        )
