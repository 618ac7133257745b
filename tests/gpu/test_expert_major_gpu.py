"""Fused permute (``dispatch(..., expert_major=True)``) on the CUDA backend vs the reference backend, bit for bit,
with N ranks sharing the GPU(s); and vs the unfused path (dispatch, permute, un-permute, combine) on the same backend.

The CUDA backend serves expert-major calls by the engine's dispatch/combine plus a device gather and a fixed-order
device sum (``CudaBackend.dispatch_expert_major``: a fallback until a fused kernel exists); these tests hold any
implementation of it to the reference. Run under MPS (tests/gpu/run_device.sh, phase ``tests``).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests import reference_cases as rc
from tests.dist import run
from tests.poison import poison_allocator

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
try:
    import ep_dispatcher._C  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the build
    pytest.skip(f"ep_dispatcher._C is not built: {e}", allow_module_level=True)

from ep_dispatcher import Buffer, Config, per_token_cast_to_fp8  # noqa: E402
from ep_dispatcher import autograd as ep_autograd  # noqa: E402
from ep_dispatcher.expert_major import expert_major_layout, permute, permute_probs, unpermute  # noqa: E402

WORLDS = [int(w) for w in os.environ.get("EP_GPU_TEST_WORLDS", "2,4,8").split(",")]
NUM_NVL_BYTES = 1 << 30  # as tests/gpu/test_intranode_gpu.py
NUM_SMS = 8  # per rank: 8 ranks x 8 SMs fit on one H200


def _set_device(rank: int) -> torch.device:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def _compare_case(cuda: Buffer, ref: Buffer, case: rc.Case, me: int, device) -> None:
    x, topk_idx, topk_weights = (t.to(device) for t in rc.rank_inputs(case, me))
    config = Config(NUM_SMS)
    poison_allocator(64 << 20, device)  # a row the permute forgot to write cannot pass by holding old data
    per_rank, _, per_expert, in_rank, _ = cuda.get_dispatch_layout(topk_idx, case.num_experts)
    alignment = (1, 4, 128)[case.seed % 3]
    kwargs = dict(
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        expert_alignment=alignment,
    )
    out_c = cuda.dispatch(x, expert_major=True, config=config, **kwargs)
    out_r = ref.dispatch(x, expert_major=True, **kwargs)
    for name, a, b in zip(("recv_x", "recv_topk_idx", "recv_topk_weights"), out_c[:3], out_r[:3]):
        assert torch.equal(a, b), f"expert-major {name}"
    assert out_c[3] == out_r[3], "num_recv_tokens_per_expert_list"
    lc, lr = out_c[4].expert_major, out_r[4].expert_major
    assert torch.equal(lc.row_map, lr.row_map) and torch.equal(lc.row_pair, lr.row_pair), "layout"
    assert bool((out_c[0][lc.row_pair < 0] == 0).all()), "padding rows are zeros"

    # Combine from expert-major rows (bias pair, weights): bit-exact with the reference.
    g = torch.Generator().manual_seed(case.seed + 5)
    biases = tuple(torch.randn((x.size(0), case.hidden), generator=g).to(torch.bfloat16).to(device) for _ in range(2))
    y = rc.expert_fn(me, out_c[0])
    comb_c = cuda.combine(y, out_c[4], topk_weights=out_c[2], bias=biases, config=config)
    comb_r = ref.combine(y, out_r[4], topk_weights=out_r[2], bias=biases)
    assert torch.equal(comb_c[0], comb_r[0]) and torch.equal(comb_c[1], comb_r[1]), "expert-major combine"

    # ... and with the unfused path on the CUDA backend: received-order dispatch, permute, un-permute, combine.
    plain = cuda.dispatch(x, config=config, **kwargs)
    layout = expert_major_layout(plain[1], case.num_experts // case.num_ranks, alignment, sum(plain[3]))
    assert torch.equal(permute(plain[0], layout), out_c[0]), "fused == dispatch + permute"
    unfused = cuda.combine(unpermute(y, layout), plain[4], topk_weights=plain[2], bias=biases, config=config)
    assert torch.equal(unfused[0], comb_c[0]), "fused combine == un-permute + combine"

    # Cached dispatch into the handle's expert-major layout; FP8 payloads (data and scales permuted alike).
    x2 = (x.float() * 3 - 1).to(torch.bfloat16)
    cached_c = cuda.dispatch(x2, handle=out_c[4], config=config)[0]
    assert torch.equal(cached_c, ref.dispatch(x2, handle=out_r[4])[0]), "cached expert-major"
    if case.hidden % 128 == 0:
        x8 = per_token_cast_to_fp8(x)
        (d_c, s_c), *_ = cuda.dispatch(x8, expert_major=True, config=config, **kwargs)
        (d_r, s_r), *_ = ref.dispatch(x8, expert_major=True, **kwargs)
        assert torch.equal(d_c.view(torch.uint8), d_r.view(torch.uint8)) and torch.equal(s_c, s_r), "fp8"


def _compare_worker(rank: int, world: int, seeds) -> int:
    device = _set_device(rank)
    cuda = Buffer(None, num_nvl_bytes=NUM_NVL_BYTES, backend="cuda", timeout_s=60)
    ref = Buffer(None, num_nvl_bytes=NUM_NVL_BYTES, backend="reference")
    cuda._backend.ipc.poison_receive_pool(True)
    for seed in seeds:
        case = rc.random_case(seed, world, hidden_choices=(2048, 4096, 1024 + 8))
        try:
            _compare_case(cuda, ref, case, rank, device)
        except AssertionError as e:
            raise AssertionError(f"rank {rank} {case}: {e}") from e
    torch.cuda.synchronize()
    cuda.destroy()
    return len(seeds)


@pytest.mark.parametrize("world", WORLDS)
def test_expert_major_matches_reference(world: int) -> None:
    seeds = [9500 + world * 10 + i for i in range(3)]
    assert run(_compare_worker, world, seeds) == [len(seeds)] * world


def _autograd_worker(rank: int, world: int) -> None:
    """Differentiable fused pair == unfused pair on the CUDA backend: outputs and gradients bit-identical (BF16)."""
    device = _set_device(rank)
    buffer = Buffer(None, num_nvl_bytes=NUM_NVL_BYTES, backend="cuda", timeout_s=60)
    case = rc.random_case(777 + world, world, hidden_choices=(2048,))
    x0, topk_idx, w0 = (t.to(device) for t in rc.rank_inputs(case, rank))
    grad_out = (x0.float() * 0.25 + 1).to(torch.bfloat16)
    num_local = case.num_experts // world
    results = []
    for fused in (True, False):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        recv_x, recv_idx, recv_w, counts, handle = ep_autograd.dispatch(
            buffer, x, topk_idx, w, case.num_experts, expert_alignment=8, expert_major=fused
        )
        layout = handle.expert_major if fused else expert_major_layout(recv_idx, num_local, 8, sum(counts))
        rows = recv_x if fused else permute(recv_x, layout)
        y = (rows.float() * permute_probs(recv_w, layout).unsqueeze(1) * (rank + 1)).to(torch.bfloat16)
        out = ep_autograd.combine(buffer, y if fused else unpermute(y, layout), handle)
        out.backward(grad_out)
        results.append((out.detach(), x.grad, w.grad))
    for name, a, b in zip(("output", "grad x", "grad topk_weights"), *results):
        assert torch.equal(a, b), f"rank {rank}: {name}"
    torch.cuda.synchronize()
    buffer.destroy()


@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
def test_expert_major_autograd_matches_unfused(world: int) -> None:
    run(_autograd_worker, world)
