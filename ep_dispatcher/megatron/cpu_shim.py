"""Run megatron-core's MoE layers and GPTModel on CPU (gloo), for tests and examples on machines without a GPU.

Megatron-core assumes CUDA in places a CPU forward/backward reaches:
* ``TopKRouter`` (and a few buffers) are placed on ``torch.cuda.current_device()``;
* attention dropout runs under ``get_cuda_rng_tracker().fork()``, whose states live in the CUDA RNG;
* 0.16: the router's gating GEMM tests ``te_general_gemm is not None``, but ``moe_utils`` defines that name only
  when Transformer Engine (a CUDA library) imports, so without TE every router forward raises ``NameError``.
``enable()`` makes ``torch.cuda.current_device()`` return ``"cpu"``, lets ``fork()`` of a state that was never
added (no CUDA RNG to add it to) run the body unchanged, on the CPU generator, and defines a missing
``te_general_gemm`` as ``None`` (the router then uses ``torch.mm``, as 0.17+ do without TE). It does nothing when
a GPU is visible. Call it in each rank's process before building the model.
"""

from __future__ import annotations

import contextlib

import torch

_enabled = False


def enable() -> bool:
    """Apply the CPU patches in this process (idempotent); returns whether they are active."""
    global _enabled
    if torch.cuda.is_available():
        return False
    if _enabled:
        return True
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core.tensor_parallel import random as mp_random

    tracker_cls = type(mp_random.get_cuda_rng_tracker())
    original_fork = tracker_cls.fork

    def fork(self, name=mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name in self.states_:
            return original_fork(self, name)
        return contextlib.nullcontext()

    tracker_cls.fork = fork
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16 without Transformer Engine (0.17+ define it as None)
        moe_utils.te_general_gemm = None
    _enabled = True
    return True
