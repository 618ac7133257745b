"""Fused permute (``dispatch(..., expert_major=True)``) on the CUDA backend vs the reference backend, bit for bit,
with N ranks sharing the GPU(s); and vs the unfused path (dispatch, permute, un-permute, combine) on the same backend.

Every test runs twice, with ``EP_DISPATCHER_FUSED_EXPERT_MAJOR`` set to ``1`` and to ``0`` in the spawned ranks: with
``1`` the intranode engine's fused kernels serve the expert-major dispatch and cached dispatch (rows written straight
into their expert-major slots) and the expert-major combine (each token's rows summed while it is pushed back), with
``0`` the fallback (engine dispatch plus a device gather; a fixed-order device un-permute before the engine combine).
The combine is checked with ``y`` fresh and with ``y`` written into ``recv_x`` (in the receive pool; the fused
combine pushes either way), and against the unfused combine pulling its un-permuted input from the pool. Run under MPS
(tests/gpu/run_device.sh, phase ``tests``).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests import reference_cases as rc
from tests.dist import run
from tests.gpu.common import NUM_SMS, WORLDS, require_extension, set_device
from tests.poison import poison_allocator

pytestmark = pytest.mark.gpu
require_extension()

from ep_dispatcher import Buffer, Config, per_token_cast_to_fp8  # noqa: E402
from ep_dispatcher import autograd as ep_autograd  # noqa: E402
from ep_dispatcher.expert_major import expert_major_layout, permute, permute_probs, unpermute  # noqa: E402

FUSED = pytest.mark.parametrize("fused", [True, False], ids=["fused", "fallback"])
FUSED_CALLS = ("dispatch_expert_major", "cached_dispatch_expert_major", "combine_expert_major")
NUM_NVL_BYTES = 1 << 30  # as tests/gpu/test_intranode_gpu.py


def _switch(fused: bool) -> None:
    """Set in the spawned rank (settings.py reads it per call)."""
    os.environ["EP_DISPATCHER_FUSED_EXPERT_MAJOR"] = "1" if fused else "0"


def _check_engine_calls(cuda: Buffer, fused: bool) -> None:
    calls = set(cuda.engine_calls)
    assert set(FUSED_CALLS) <= calls if fused else not set(FUSED_CALLS) & calls, f"fused={fused}: {cuda.engine_calls}"


def _compare_case(cuda: Buffer, ref: Buffer, case: rc.Case, me: int, device, alignment: int, fused: bool) -> None:
    x, topk_idx, topk_weights = (t.to(device) for t in rc.rank_inputs(case, me))
    config = Config(NUM_SMS)
    poison_allocator(64 << 20, device)  # a row the permute forgot to write cannot pass by holding old data
    per_rank, _, per_expert, in_rank, _ = cuda.get_dispatch_layout(topk_idx, case.num_experts)
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
    hc, hr = out_c[4], out_r[4]
    assert (getattr(hc.backend_state, "expert_pairs", None) is not None) == fused, "served by the fused kernel iff on"
    assert torch.equal(hc.num_recv_tokens_per_expert, hr.num_recv_tokens_per_expert), "per-expert counts (device)"
    assert torch.equal(hc.recv_src_idx, hr.recv_src_idx) and hc.num_recv_tokens == hr.num_recv_tokens, "handle"
    lc, lr = hc.expert_major, hr.expert_major
    assert (lc.num_rows, lc.num_topk, lc.expert_alignment) == (lr.num_rows, lr.num_topk, lr.expert_alignment)
    assert lc.row_map.dtype == lr.row_map.dtype and lc.row_pair.dtype == lr.row_pair.dtype, "layout dtypes"
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
    assert torch.equal(unfused[0], comb_c[0]) and torch.equal(unfused[1], comb_c[1]), "== un-permute + combine"
    # One bias, no weights; and fp32 rows (the engine sums both dtypes).
    comb1 = cuda.combine(y, out_c[4], bias=biases[0], config=config)
    assert comb1[1] is None and torch.equal(comb1[0], ref.combine(y, out_r[4], bias=biases[0])[0]), "one bias"
    y32, biases32 = y.float() * 0.75, tuple(b.float() for b in biases)
    comb32 = cuda.combine(y32, out_c[4], topk_weights=out_c[2], bias=biases32, config=config)
    ref32 = ref.combine(y32, out_r[4], topk_weights=out_r[2], bias=biases32)
    assert torch.equal(comb32[0], ref32[0]) and torch.equal(comb32[1], ref32[1]), "fp32 expert-major combine"

    # Cached dispatch into the handle's expert-major layout (twice: the second reuses the pair table the first read).
    for scale in (3, -0.5):
        x2 = (x.float() * scale - 1).to(torch.bfloat16)
        cached_c = cuda.dispatch(x2, handle=out_c[4], config=config)[0]
        assert torch.equal(cached_c, ref.dispatch(x2, handle=out_r[4])[0]), "cached expert-major"
        assert torch.equal(cached_c, permute(cuda.dispatch(x2, handle=plain[4], config=config)[0], layout)), "cached"

    # FP8 payloads (data and scales permuted alike), fresh and cached (an FP8 handle, a BF16 cached call and back).
    if case.hidden % 128 == 0:
        x8 = per_token_cast_to_fp8(x)
        (d_c, s_c), idx_c, w_c, list_c, h8_c, _ = cuda.dispatch(x8, expert_major=True, config=config, **kwargs)
        (d_r, s_r), idx_r, w_r, list_r, h8_r, _ = ref.dispatch(x8, expert_major=True, **kwargs)
        assert torch.equal(d_c.view(torch.uint8), d_r.view(torch.uint8)) and torch.equal(s_c, s_r), "fp8"
        assert torch.equal(idx_c, idx_r) and torch.equal(w_c, w_r) and list_c == list_r, "fp8 top-k outputs"
        l8 = h8_c.expert_major
        assert torch.equal(l8.row_map, lc.row_map) and torch.equal(l8.row_pair, lc.row_pair), "fp8 layout"
        x8b = per_token_cast_to_fp8((x.float() * 2 + 0.5).to(torch.bfloat16))
        d_c, s_c = cuda.dispatch(x8b, handle=h8_c, config=config)[0]
        d_r, s_r = ref.dispatch(x8b, handle=h8_r)[0]
        assert torch.equal(d_c.view(torch.uint8), d_r.view(torch.uint8)) and torch.equal(s_c, s_r), "cached fp8"
        pad = lc.row_pair < 0
        assert bool((d_c.view(torch.uint8)[pad] == 0).all()) and bool((s_c[pad] == 0).all()), "fp8 padding zeros"
        assert torch.equal(cuda.dispatch(x2, handle=h8_c, config=config)[0], cached_c), "bf16 through an fp8 handle"
        comb8 = cuda.combine(y, h8_c, topk_weights=w_c, bias=biases, config=config)
        assert torch.equal(comb8[0], comb_c[0]) and torch.equal(comb8[1], comb_c[1]), "combine on the fp8 handle"

    # y computed in place into recv_x (and the weights left in the pool): the combine input lies in the receive pool.
    recv_x, recv_w = out_c[0], out_c[2]
    recv_x.copy_(y)
    comb_pool = cuda.combine(recv_x, out_c[4], topk_weights=recv_w, bias=biases, config=config)
    assert torch.equal(comb_pool[0], comb_c[0]) and torch.equal(comb_pool[1], comb_c[1]), "y in the receive pool"
    # The unfused path with its un-permuted rows written into its recv_x: the engine combine pulls them.
    plain[0].copy_(unpermute(y, layout))
    pulled = cuda.combine(plain[0], plain[4], topk_weights=plain[2], bias=biases, config=config)
    assert torch.equal(pulled[0], comb_c[0]) and torch.equal(pulled[1], comb_c[1]), "== un-permute + pulled combine"


def _compare_worker(rank: int, world: int, seeds, fused: bool) -> int:
    _switch(fused)
    device = set_device(rank)
    cuda = Buffer(None, num_nvl_bytes=NUM_NVL_BYTES, backend="cuda", timeout_s=60)
    ref = Buffer(None, num_nvl_bytes=NUM_NVL_BYTES, backend="reference")
    _check_engine_calls(cuda, fused)
    cuda._backend.ipc.poison_receive_pool(True)
    cases = 0
    for seed in seeds:
        case = rc.random_case(seed, world, hidden_choices=(2048, 4096, 1024 + 8))
        for alignment in (1, 16, 128):
            try:
                _compare_case(cuda, ref, case, rank, device, alignment, fused)
            except AssertionError as e:
                raise AssertionError(f"rank {rank} fused={fused} alignment={alignment} {case}: {e}") from e
            cases += 1
    torch.cuda.synchronize()
    cuda.destroy()
    return cases


@FUSED
@pytest.mark.parametrize("world", WORLDS)
def test_expert_major_matches_reference(world: int, fused: bool) -> None:
    seeds = [9500 + world * 10 + i for i in range(3)]
    assert run(_compare_worker, world, seeds, fused) == [3 * len(seeds)] * world


def _small_pool_worker(rank: int, world: int, fused: bool) -> int:
    """A pool too small for the expert-major outputs grows on every rank together (the fused call returns the size it
    needs), and the result is still the reference's."""
    _switch(fused)
    device = set_device(rank)
    cuda = Buffer(None, num_nvl_bytes=1 << 20, backend="cuda", timeout_s=60)
    ref = Buffer(None, num_nvl_bytes=1 << 20, backend="reference")
    cuda._backend.ipc.poison_receive_pool(True)
    case = rc.random_case(4242 + world, world, hidden_choices=(4096,))
    _compare_case(cuda, ref, case, rank, device, 16, fused)
    torch.cuda.synchronize()
    cuda.destroy()
    return 1


@FUSED
@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
def test_expert_major_grows_a_small_pool(world: int, fused: bool) -> None:
    assert run(_small_pool_worker, world, fused) == [1] * world


def _input_error_worker(rank: int, world: int, fused: bool) -> list:
    """A bad top-k id on one rank raises ValueError on every rank (none hangs), and the buffer keeps working."""
    _switch(fused)
    device = set_device(rank)
    cuda = Buffer(None, num_nvl_bytes=NUM_NVL_BYTES, backend="cuda", timeout_s=60)
    ref = Buffer(None, num_nvl_bytes=NUM_NVL_BYTES, backend="reference")
    config = Config(NUM_SMS)
    num_tokens, hidden, num_experts, topk = 64, 256, 4 * world, 2
    g = torch.Generator().manual_seed(60 + rank)
    x = torch.randn((num_tokens, hidden), generator=g).to(torch.bfloat16).to(device)
    topk_idx = torch.rand((num_tokens, num_experts), generator=g).argsort(1)[:, :topk].to(device)
    topk_weights = torch.rand((num_tokens, topk), generator=g).to(device)
    per_rank, _, per_expert, in_rank, _ = cuda.get_dispatch_layout(topk_idx, num_experts)
    kwargs = dict(
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_weights=topk_weights,
        expert_alignment=4,
        expert_major=True,
    )
    bad_idx = topk_idx.clone()
    if rank == world - 1:
        bad_idx[5, 1] = num_experts + 7
    messages = []
    try:
        cuda.dispatch(x, topk_idx=bad_idx, config=config, **kwargs)
        messages.append("no error")
    except ValueError as e:
        messages.append(str(e))
    out_c = cuda.dispatch(x, topk_idx=topk_idx, config=config, **kwargs)
    out_r = ref.dispatch(x, topk_idx=topk_idx, **kwargs)
    assert torch.equal(out_c[0], out_r[0]) and torch.equal(out_c[1], out_r[1]), f"rank {rank}: after the error"
    torch.cuda.synchronize()
    cuda.destroy()
    return messages


@FUSED
@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4)])
def test_expert_major_bad_contents_raise_on_every_rank(world: int, fused: bool) -> None:
    for rank, (message,) in enumerate(run(_input_error_worker, world, fused)):
        assert "topk_idx: expected entries in [-1, " in message, (rank, message)


def _autograd_worker(rank: int, world: int, fused_kernel: bool) -> None:
    """Differentiable fused pair == unfused pair on the CUDA backend: outputs and gradients bit-identical (BF16)."""
    _switch(fused_kernel)
    device = set_device(rank)
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


@FUSED
@pytest.mark.parametrize("world", [w for w in WORLDS if w in (2, 4, 8)])
def test_expert_major_autograd_matches_unfused(world: int, fused: bool) -> None:
    run(_autograd_worker, world, fused)
