"""Multi-process test helper: ``run(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on gloo ranks."""

from __future__ import annotations

from ep_dispatcher.launch import spawn


def run(fn, world_size: int, *args, backend: str = "gloo"):
    """Run ``fn`` (a module-level function) on ``world_size`` local ranks; re-raises the first rank's failure."""
    return spawn(fn, world_size, *args, backend=backend)
