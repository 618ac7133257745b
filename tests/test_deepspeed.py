"""``ep_dispatcher.deepspeed``: equal to DeepSpeed's own MoE (outputs, l_aux, counts, every gradient), patch, engine.

Runs on CPU with gloo ranks (EP = 2, 4). DeepSpeed's gate supports k = 1 (RTS, noisy policies, used_token), k = 2
(2nd-expert sampling) and general k >= 3 (``topkgating``); all are tested, with and without capacity drops.
"""

from __future__ import annotations

import copy
import importlib
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("deepspeed", reason="DeepSpeed not installed: the DeepSpeed-MoE drop-in is not tested")

from deepspeed.moe.layer import MoE as DeepSpeedMoE  # noqa: E402
from deepspeed.moe.sharded_moe import MOELayer  # noqa: E402

from ep_dispatcher import deepspeed as ep_ds  # noqa: E402
from tests.dist import run  # noqa: E402

H, FFN, E = 16, 24, 8
TOL = dict(rtol=1e-5, atol=1e-6)  # fp32: only the order of the per-token route sum differs (ranks, then top-k)


def init_deepspeed(rank: int, world: int) -> None:
    """deepspeed.comm over the gloo group the test launcher made (DeepSpeed's own MoE needs it for its all-to-all)."""
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    import deepspeed

    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op on first use (~30 s); gloo does the job here.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")


def make_expert() -> nn.Module:
    return nn.Sequential(nn.Linear(H, FFN), nn.GELU(), nn.Linear(FFN, H))


def seed_experts(moe: nn.Module, rank: int) -> None:
    """Give every global expert its own weights (rank r holds experts r*L .. r*L+L-1), the gate one shared set."""
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    for local, expert in enumerate(experts):
        g = torch.Generator().manual_seed(1000 + rank * len(experts) + local)
        with torch.no_grad():
            for p in expert.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def build_pair(rank: int, world: int, cfg: dict):
    kwargs = dict(num_experts=E, ep_size=world, min_capacity=0)
    kwargs.update(cfg)
    torch.manual_seed(7)  # same gate (and residual MLP) on every rank, as data parallelism keeps them
    theirs = DeepSpeedMoE(H, make_expert(), **kwargs)
    seed_experts(theirs, rank)
    torch.manual_seed(8)
    ours = ep_ds.MoE(H, make_expert(), **kwargs)
    ours.load_state_dict(theirs.state_dict())  # strict: same keys and shapes
    theirs.load_state_dict(ours.state_dict())
    theirs.set_deepspeed_parallelism()
    ours.set_deepspeed_parallelism()
    return theirs, ours


def run_layer(moe: nn.Module, x: torch.Tensor, rng_seed: int, used_token=None, num_steps: int = 1):
    """Forward + backward with a fixed RNG state; returns output, l_aux, exp_counts, input grad, param grads."""
    results = []
    for step in range(num_steps):
        moe.zero_grad(set_to_none=True)
        x_in = x.detach().clone().requires_grad_()
        torch.manual_seed(rng_seed + step)  # the gate's noise, RTS and 2nd-expert sampling draw from it
        out, l_aux, exp_counts = moe(x_in, used_token)
        g = torch.Generator().manual_seed(rng_seed + 50 + step)
        loss = (out * torch.randn(out.shape, generator=g)).sum() + 0.5 * l_aux
        loss.backward()
        grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in moe.named_parameters()}
        results.append((out.detach(), l_aux.detach(), exp_counts.clone(), x_in.grad.clone(), grads))
    return results


def count_dropped_routes(moe: nn.Module, x: torch.Tensor, rng_seed: int, used_token=None) -> int:
    """Routes the capacity limit drops (same gate call and RNG as the layer's forward)."""
    torch.manual_seed(rng_seed)
    with torch.no_grad():
        gate_out = moe.deepspeed_moe.gate(x.reshape(-1, H), used_token, True, False)
    num_dropped = (gate_out[3] < 0).sum()
    if used_token is not None:
        num_dropped = num_dropped - (used_token == 0).sum() * gate_out[3].size(0)
    dist.all_reduce(num_dropped)
    return int(num_dropped)


def assert_same(expected, got) -> None:
    for (out_e, l_e, c_e, gx_e, gp_e), (out_o, l_o, c_o, gx_o, gp_o) in zip(expected, got):
        torch.testing.assert_close(out_o, out_e, **TOL)
        torch.testing.assert_close(l_o, l_e, rtol=0, atol=0)  # the same gate computation: bit-exact
        assert torch.equal(c_o, c_e), (c_o, c_e)
        torch.testing.assert_close(gx_o, gx_e, **TOL)
        assert gp_o.keys() == gp_e.keys()
        for name in gp_e:
            assert (gp_o[name] is None) == (gp_e[name] is None), name
            if gp_e[name] is not None:
                torch.testing.assert_close(gp_o[name], gp_e[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _compare_case(
    rank: int, world: int, cfg: dict, num_tokens: int, expect_drops: bool, used_token_frac: float, eval_mode: bool
) -> int:
    theirs, ours = build_pair(rank, world, cfg)
    assert type(ours.deepspeed_moe) is ep_ds.EPMOELayer and type(theirs.deepspeed_moe) is MOELayer
    if eval_mode:
        theirs.eval()
        ours.eval()
    g = torch.Generator().manual_seed(31 + rank)
    x = torch.randn((2, num_tokens // 2, H), generator=g)
    used_token = None
    if used_token_frac:
        used_token = (torch.rand(num_tokens, generator=g) > used_token_frac).float()
    seed = 123 + rank
    num_dropped = count_dropped_routes(theirs, x, seed, used_token)
    assert (num_dropped > 0) == expect_drops, num_dropped
    assert_same(run_layer(theirs, x, seed, used_token, num_steps=2), run_layer(ours, x, seed, used_token, num_steps=2))
    # Parameter attributes DeepSpeed uses to keep expert gradients out of the data-parallel all-reduce.
    for (name_e, p_e), (name_o, p_o) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert name_e == name_o
        assert getattr(p_o, "allreduce", True) == getattr(p_e, "allreduce", True)
        assert getattr(p_o, "group_name", None) == getattr(p_e, "group_name", None)
    return num_dropped


CASES = {
    # name: (world, layer kwargs, tokens per rank, capacity drops expected, used_token fraction, eval)
    "k1_rts_rsample_drops": (2, dict(k=1, capacity_factor=0.5, noisy_gate_policy="RSample"), 32, True, 0.0, False),
    # k=1 with drop_tokens=False fails inside DeepSpeed 0.19.8's own top1gating (torch.topk gets a tensor k), so
    # the no-drop top-1 case uses a capacity large enough instead.
    "k1_jitter_used_token": (2, dict(k=1, noisy_gate_policy="Jitter", capacity_factor=4.0), 32, False, 0.25, False),
    "k1_ep4_drops_no_rts": (4, dict(k=1, capacity_factor=0.5, use_rts=False), 32, True, 0.0, False),
    "k2_sampling_drops": (2, dict(k=2, capacity_factor=0.5), 32, True, 0.0, False),
    "k2_no_sampling_nodrop_ep4": (
        4,
        dict(k=2, drop_tokens=False, top2_2nd_expert_sampling=False),
        24,
        False,
        0.0,
        False,
    ),
    "k2_residual_ep4_drops": (4, dict(k=2, capacity_factor=0.5, use_residual=True), 32, True, 0.0, False),
    "k4_drops_ep4": (4, dict(k=4, capacity_factor=0.5), 32, True, 0.0, False),
    "k4_nodrop": (2, dict(k=4, drop_tokens=False), 32, False, 0.0, False),
    "k2_eval_capacity": (2, dict(k=2, capacity_factor=0.25, eval_capacity_factor=4.0), 32, False, 0.0, True),
}


def _compare_worker(rank: int, world: int, names: list) -> dict:
    """All cases of one world size in one launch (starting ranks dominates the cost); failures name the case."""
    init_deepspeed(rank, world)
    dropped = {}
    for name in names:
        try:
            dropped[name] = _compare_case(rank, world, *CASES[name][1:])
        except Exception as e:
            raise AssertionError(f"case {name}: {e}") from e
    return dropped


@pytest.mark.parametrize("world", [2, 4])
def test_matches_deepspeed_moe(world):
    names = [name for name, case in CASES.items() if case[0] == world]
    results = run(_compare_worker, world, names)
    assert all(set(r) == set(names) for r in results)


class TinyModel(nn.Module):
    def __init__(self, moe_cls, world: int, num_layers: int = 2):
        super().__init__()
        self.inp = nn.Linear(H, H)
        self.moes = nn.ModuleList(
            moe_cls(H, make_expert(), num_experts=E, ep_size=world, k=2, min_capacity=0, capacity_factor=0.75)
            for _ in range(num_layers)
        )
        self.out = nn.Linear(H, H)

    def forward(self, x):
        h = self.inp(x)
        l_total = 0.0
        for moe in self.moes:
            y, l_aux, _ = moe(h)
            h = h + y
            l_total = l_total + l_aux
        return self.out(h), l_total


def _patch_worker(rank: int, world: int) -> None:
    init_deepspeed(rank, world)
    torch.manual_seed(3)
    theirs = TinyModel(DeepSpeedMoE, world)
    for moe in theirs.moes:
        seed_experts(moe, rank)
    ours = copy.deepcopy(theirs)  # before the groups are set: a ProcessGroup cannot be deep-copied
    for moe in (*theirs.moes, *ours.moes):
        moe.set_deepspeed_parallelism()
    params_before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    assert ep_ds.patch(ours) == 2
    assert ep_ds.patch(ours) == 0  # already switched
    assert all(type(m.deepspeed_moe) is ep_ds.EPMOELayer for m in ours.moes)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for n, p in ours.named_parameters():
        assert torch.equal(p, params_before[n]), n

    x = torch.randn((24, H), generator=torch.Generator().manual_seed(rank))
    outs = []
    for model in (theirs, ours):
        torch.manual_seed(55 + rank)
        model.zero_grad()
        xin = x.clone().requires_grad_()
        out, l_aux = model(xin)
        (out.square().mean() + 0.1 * l_aux).backward()
        outs.append((out.detach(), l_aux.detach(), xin.grad, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (o_e, l_e, gx_e, gp_e), (o_o, l_o, gx_o, gp_o) = outs
    torch.testing.assert_close(o_o, o_e, **TOL)
    torch.testing.assert_close(l_o, l_e, **TOL)
    torch.testing.assert_close(gx_o, gx_e, **TOL)
    for n in gp_e:
        torch.testing.assert_close(gp_o[n], gp_e[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
    assert ep_ds.unpatch(ours) == 2
    assert all(type(m.deepspeed_moe) is MOELayer for m in ours.moes)


def test_patch_and_unpatch():
    run(_patch_worker, 2)


def _engine_worker(rank: int, world: int, ours: bool, num_steps: int) -> list:
    init_deepspeed(rank, world)
    import deepspeed

    torch.manual_seed(11)
    model = TinyModel(ep_ds.MoE if ours else DeepSpeedMoE, world, num_layers=1)
    for moe in model.moes:
        seed_experts(moe, rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "steps_per_print": 10**6}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    losses = []
    for step in range(num_steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn((16, H), generator=g), torch.randn((16, H), generator=g)
        torch.manual_seed(1000 + 10 * step + rank)
        out, l_aux = engine(x)
        loss = nn.functional.mse_loss(out, y) + 0.01 * l_aux
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_deepspeed_initialize_training_same_losses():
    theirs = run(_engine_worker, 2, False, 4)
    ours = run(_engine_worker, 2, True, 4)
    for rank, (a, b) in enumerate(zip(theirs, ours)):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6), (rank, a, b)  # fp32, 4 SGD steps


def test_single_process_ep1_without_group():
    """ep_size=1 and no process group: every expert is local; same results as DeepSpeed's layer."""
    torch.manual_seed(5)
    theirs = DeepSpeedMoE(H, make_expert(), num_experts=4, k=2, min_capacity=0, capacity_factor=0.5)
    seed_experts(theirs, 0)
    ours = copy.deepcopy(theirs)
    ep_ds.patch(ours)
    x = torch.randn((3, 8, H), generator=torch.Generator().manual_seed(1))
    assert_same(run_layer(theirs, x, 9), run_layer(ours, x, 9))


def test_unsupported_options_raise():
    with pytest.raises(NotImplementedError, match="use_tutel"):
        ep_ds.MoE(H, make_expert(), num_experts=2, use_tutel=True)
    with pytest.raises(NotImplementedError, match="enable_expert_tensor_parallelism"):
        ep_ds.MoE(H, make_expert(), num_experts=2, enable_expert_tensor_parallelism=True)
    with pytest.raises(ValueError, match=r"k: expected an int in \[1, num_experts=2\], got 3"):
        ep_ds.MoE(H, make_expert(), num_experts=2, k=3)
    with pytest.raises(ValueError, match="contains no deepspeed"):
        ep_ds.patch(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        ep_ds.patch("model")
    layer = ep_ds.MoE(H, make_expert(), num_experts=4, ep_size=2, min_capacity=0)
    with pytest.raises(RuntimeError, match="call set_deepspeed_parallelism"):
        layer(torch.randn(8, H))
    tutel_layer = DeepSpeedMoE(H, make_expert(), num_experts=2)
    tutel_layer.deepspeed_moe.use_tutel = True  # as if Tutel were installed
    with pytest.raises(NotImplementedError, match="Tutel"):
        ep_ds.patch(tutel_layer)


def test_constructor_signature_matches_deepspeed():
    import inspect

    theirs = inspect.signature(DeepSpeedMoE.__init__).parameters
    ours = inspect.signature(ep_ds.MoE.__init__).parameters
    assert [(n, p.default) for n, p in ours.items()] == [(n, p.default) for n, p in theirs.items()]


def _fused_permute_worker(rank: int, world: int, k: int, dtype_name: str) -> None:
    """The drop-in with the fused permute (expert-major receive, combine from it) against the same layer with separate
    permute / un-permute passes: outputs, l_aux and every gradient bit-identical."""
    init_deepspeed(rank, world)
    dtype = getattr(torch, dtype_name)
    x = torch.randn(3, 10, H, generator=torch.Generator().manual_seed(rank)).to(dtype)
    results = {}
    defaults = (ep_ds.EPMOELayer.fused_permute, ep_ds.EPMOELayer.fixed_order_unpermute)
    for fused in (True, False):
        ep_ds.EPMOELayer.fused_permute = fused
        ep_ds.EPMOELayer.fixed_order_unpermute = not fused  # the fused path's arithmetic as separate passes
        try:
            _, moe = build_pair(rank, world, dict(k=k, capacity_factor=2.0))  # the same weights both times
            moe = moe.to(dtype)
            x_in = x.clone().requires_grad_()
            torch.manual_seed(5)
            out, l_aux, _ = moe(x_in)
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(9 + rank)).to(dtype))
            results[fused] = (out.detach(), l_aux.detach(), x_in.grad, {n: p.grad for n, p in moe.named_parameters()})
        finally:
            ep_ds.EPMOELayer.fused_permute = defaults[0]
            ep_ds.EPMOELayer.fixed_order_unpermute = defaults[1]
    (o_f, l_f, gx_f, gp_f), (o_u, l_u, gx_u, gp_u) = results[True], results[False]
    assert torch.equal(o_f, o_u) and torch.equal(l_f, l_u) and torch.equal(gx_f, gx_u)
    for name in gp_f:
        assert (gp_f[name] is None) == (gp_u[name] is None), name
        assert gp_f[name] is None or torch.equal(gp_f[name], gp_u[name]), name
    ep_ds.clear_buffers()


def test_fused_permute_is_on_by_default():
    """The drop-in dispatches straight into expert-major rows unless told otherwise (GPU-validated fused kernels)."""
    assert ep_ds.EPMOELayer.fused_permute is True and ep_ds.EPMOELayer.fixed_order_unpermute is False


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("k,dtype_name", [(2, "float32"), (4, "bfloat16")])
def test_fused_permute_matches_unfused(world, k, dtype_name):
    run(_fused_permute_worker, world, k, dtype_name)
