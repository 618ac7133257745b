"""``install()``: teach megatron-core the token dispatcher type ``"deepep"`` (and route flex/deepep to us).

Megatron-core has no registry for token dispatchers: ``MoELayer.__init__`` picks one by comparing
``config.moe_token_dispatcher_type`` with ``"allgather"``, ``"alltoall"`` and ``"flex"``, and
``TransformerConfig.__post_init__`` (plus the EP-overlap schedule's ``should_free_input``) accept only those
names. ``install()`` wraps those three places; nothing else in Megatron is modified:

* ``TransformerConfig.__post_init__``: a ``"deepep"`` config is validated as ``"flex"`` with backend ``"deepep"``
  (the same rules: shared-expert overlap allowed, ``overlap_moe_expert_parallel_comm`` allowed, no
  ``moe_pad_expert_input_to_capacity``), then keeps ``"deepep"``.
* ``MoELayer.__init__``: for ``"deepep"`` (and, unless ``route_flex=False``, for ``"flex"`` with backend
  ``"deepep"``) the layer is built with the trivial ``allgather`` dispatcher, which is then replaced by
  ``EPDispatcherTokenDispatcher`` (shared experts re-attached when overlapped). The flex path never constructs
  Megatron's ``_DeepepManager``, so DeepEP need not be installed.
* ``should_free_input`` (EP-overlap schedule): ``"deepep"`` gets the flex/deepep policy: the dispatch node keeps
  its input (it aliases the router's input, which the router's backward needs); the combine node frees its input
  (combine's backward does not read it). The expert node frees its input only without the fused permute (then it
  is the received rows, which the permutation copied); with it (the default) the input is the experts' own input and
  is kept, as Megatron does for HybridEP. This applies to flex/deepep configs routed to us too.

Tested with megatron-core 0.16.1, 0.17.1, 0.18.2 and 0.19.2 (CPU, gloo: tests/test_megatron.py and
tests/test_megatron_example.py, all of them run in .ci/run). What differs between them (where ``should_free_input``
lives and its arguments, the SM-count field, whether flex allows shared-expert overlap) is found by feature
detection, not by version; docs/megatron.md has the table.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Callable

TYPE_NAME = "deepep"
# Where should_free_input lives: models/common/utils.py in 0.19, models/gpt/fine_grained_callables.py in 0.16-0.18.
# Its signature is (name, is_moe, config) in 0.16 and (name, is_moe, config, num_local_experts) in 0.17+.
_FREE_INPUT_MODULES = (
    "megatron.core.models.common.utils",
    "megatron.core.models.gpt.fine_grained_callables",
)

_state: dict[str, object] = {"installed": False, "route_flex": True}
_originals: list[tuple[object, str, Callable]] = []


def is_flex_deepep(config) -> bool:
    """``moe_token_dispatcher_type="flex"`` with the DeepEP backend (0.19: ``moe_flex_dispatcher_backend``;
    older: ``moe_enable_deepep``)."""
    if getattr(config, "moe_token_dispatcher_type", None) != "flex":
        return False
    if hasattr(config, "moe_flex_dispatcher_backend"):
        return config.moe_flex_dispatcher_backend == "deepep"
    return bool(getattr(config, "moe_enable_deepep", False))


def uses_ep_dispatcher(config) -> bool:
    """Whether ``MoELayer`` builds ``EPDispatcherTokenDispatcher`` for ``config`` (after ``install()``)."""
    if getattr(config, "moe_token_dispatcher_type", None) == TYPE_NAME:
        return True
    return bool(_state["installed"] and _state["route_flex"] and is_flex_deepep(config))


@contextlib.contextmanager
def _config_as(config, dispatcher_type: str, flex_deepep: bool):
    """Temporarily present ``config`` as another dispatcher type (restored even if the body raises)."""
    saved = {
        name: getattr(config, name)
        for name in ("moe_token_dispatcher_type", "moe_flex_dispatcher_backend", "moe_enable_deepep")
        if hasattr(config, name)
    }
    object.__setattr__(config, "moe_token_dispatcher_type", dispatcher_type)
    if flex_deepep:
        if "moe_flex_dispatcher_backend" in saved:
            object.__setattr__(config, "moe_flex_dispatcher_backend", "deepep")
        elif "moe_enable_deepep" in saved:
            object.__setattr__(config, "moe_enable_deepep", True)
    try:
        yield
    finally:
        for name, value in saved.items():
            object.__setattr__(config, name, value)


def _patch(owner, name: str, make: Callable[[Callable], Callable]) -> None:
    original = getattr(owner, name)
    wrapped = make(original)
    functools.update_wrapper(wrapped, original)
    wrapped.__ep_dispatcher_wrapped__ = original
    setattr(owner, name, wrapped)
    _originals.append((owner, name, original))


def _wrap_post_init(original):
    def __post_init__(self, *args, **kwargs):
        if getattr(self, "moe_token_dispatcher_type", None) != TYPE_NAME:
            return original(self, *args, **kwargs)
        try:
            with _config_as(self, "flex", flex_deepep=True):
                return original(self, *args, **kwargs)
        except (ValueError, AssertionError) as e:
            # Megatron's message names flex/alltoall (e.g. 0.16/0.17: "moe_shared_expert_overlap only works with
            # alltoall token dispatcher"); say why a "deepep" config got it (notes: Python 3.11+).
            if hasattr(e, "add_note"):
                e.add_note(
                    f"ep_dispatcher.megatron: moe_token_dispatcher_type={TYPE_NAME!r} is checked by this "
                    f"megatron-core's flex/deepep rules (megatron-core {megatron_version()})"
                )
            raise

    return __post_init__


def _wrap_moe_layer_init(original):
    signature = inspect.signature(original)

    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        config = bound.arguments.get("config")
        if config is None or not uses_ep_dispatcher(config):
            return original(self, *args, **kwargs)
        from .token_dispatcher import EPDispatcherTokenDispatcher

        if "pg_collection" in signature.parameters and bound.arguments.get("pg_collection") is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            bound.arguments["pg_collection"] = get_default_pg_collection()
        pg_collection = bound.arguments.get("pg_collection")
        # Build with the allgather dispatcher (no communication, no buffers), then swap ours in.
        with _config_as(config, "allgather", flex_deepep=False):
            original(*bound.args, **bound.kwargs)
        placeholder = self.token_dispatcher
        dispatcher = EPDispatcherTokenDispatcher(
            self.num_local_experts, self.local_expert_indices, config=config, pg_collection=pg_collection
        )
        if self.shared_experts is not None and getattr(self, "shared_expert_overlap", False):
            dispatcher.set_shared_experts(self.shared_experts)
        self.token_dispatcher = dispatcher
        if getattr(self, "_training_token_dispatcher", None) is placeholder:
            self._training_token_dispatcher = dispatcher

    return __init__


def _wrap_should_free_input(original):
    def should_free_input(name, is_moe, config, *args, **kwargs):
        ours = getattr(config, "moe_token_dispatcher_type", None) == TYPE_NAME
        if not uses_ep_dispatcher(config):
            return original(name, is_moe, config, *args, **kwargs)
        from .token_dispatcher import EPDispatcherTokenDispatcher

        if name == "mlp" and is_moe and EPDispatcherTokenDispatcher.fused_permute:
            # Fused permute: the expert node's input IS the experts' input (received expert-major, no permutation
            # copy in between), which their backward keeps: retain it, as Megatron does for HybridEP's permuting
            # dispatch.
            return False
        if not ours:  # flex/deepep routed to us: already Megatron's flex/deepep policy
            return original(name, is_moe, config, *args, **kwargs)
        with _config_as(config, "flex", flex_deepep=True):
            return original(name, is_moe, config, *args, **kwargs)

    return should_free_input


def megatron_version() -> str | None:
    """The installed megatron-core version, or ``None`` when it cannot be imported."""
    try:
        from megatron.core import package_info
    except ImportError:
        return None
    return getattr(package_info, "__version__", None)


def install(route_flex: bool = True, backend: str | None = None) -> None:
    """Register ``moe_token_dispatcher_type="deepep"`` with megatron-core (idempotent).

    Args:
        route_flex: also serve ``moe_token_dispatcher_type="flex"`` with backend ``"deepep"`` (Megatron-LM's
            ``--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep``) with ``ep_dispatcher``.
        backend: ``Buffer`` backend for the dispatcher's buffers: ``"auto"`` (CUDA engine when built and a GPU is
            visible), ``"cuda"`` or ``"reference"``; ``None`` keeps env ``EP_DISPATCHER_MEGATRON_BACKEND`` or
            ``"auto"``.
    Raises:
        ImportError: megatron-core is not importable.
        RuntimeError: this megatron-core lacks a piece the plugin hooks into (names the piece).
    """
    from . import buffer_cache

    if backend is not None:
        if backend not in ("auto", "cuda", "reference"):
            raise ValueError(f"backend: expected 'auto', 'cuda', 'reference' or None, got {backend!r}")
        buffer_cache.set_backend(backend)
    _state["route_flex"] = bool(route_flex)
    if _state["installed"]:
        return
    try:
        from megatron.core.transformer import transformer_config
        from megatron.core.transformer.moe import moe_layer
    except ImportError as e:
        raise ImportError(
            f"ep_dispatcher.megatron.install: megatron-core is not importable ({e}); "
            "pip install megatron-core (0.16 ... 0.19)"
        ) from e
    for owner, name in ((transformer_config.TransformerConfig, "__post_init__"), (moe_layer.MoELayer, "__init__")):
        if not callable(getattr(owner, name, None)):
            raise RuntimeError(  # noqa: TRY004  (a missing hook point, not a wrong argument type)
                f"ep_dispatcher.megatron.install: megatron-core {megatron_version()} has no "
                f"{owner.__name__}.{name}; this version is not supported"
            )
    _patch(transformer_config.TransformerConfig, "__post_init__", _wrap_post_init)
    _patch(moe_layer.MoELayer, "__init__", _wrap_moe_layer_init)
    for module_name in _FREE_INPUT_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        fn = module.__dict__.get("should_free_input")
        if callable(fn) and not hasattr(fn, "__ep_dispatcher_wrapped__"):
            _patch(module, "should_free_input", _wrap_should_free_input)
    _state["installed"] = True


def uninstall() -> None:
    """Undo ``install()`` (tests)."""
    while _originals:
        owner, name, original = _originals.pop()
        setattr(owner, name, original)
    _state["installed"] = False


def is_installed() -> bool:
    return bool(_state["installed"])
