"""Shared pytest fixtures."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from ep_dispatcher.launch import free_port


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group in the test process, for checks that need a ``Buffer`` but no peer."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()
