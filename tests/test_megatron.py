"""Megatron-core plugin (ep_dispatcher.megatron): routing helpers, config registration, a full ``MoELayer`` with
``moe_token_dispatcher_type="deepep"`` against Megatron's ``allgather`` dispatcher, the dropless round trip, and a
GPTModel through the combined-1F1B EP-overlap schedule against the plain schedule. CPU, gloo, reference backend.
"""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

from ep_dispatcher.megatron.routing import expert_major_order, fold_tensor_parallel, routing_to_topk
from tests.dist import run

try:
    import megatron.core  # noqa: F401

    MEGATRON_SKIP_REASON = None
except Exception as e:  # noqa: BLE001  (ImportError, or a broken dependency such as triton raising anything)
    MEGATRON_SKIP_REASON = f"megatron-core is not importable: {type(e).__name__}: {e}"

requires_megatron = pytest.mark.skipif(MEGATRON_SKIP_REASON is not None, reason=MEGATRON_SKIP_REASON or "")

NUM_EXPERTS, TOPK, HIDDEN, FFN = 8, 2, 16, 32
# fp32 end to end. Same expert rows in the same order as allgather, so outputs and gradients agree bit for bit at
# TP=1 (observed); the only reordering is the final cross-rank sum (our fixed rank order vs gloo's reduce-scatter)
# and, at TP=2, the sum of the TP partials: a few fp32 ulps.
LAYER_RTOL, LAYER_ATOL = 1e-5, 1e-6


# ---------------------------------------------------------------------------------------------- pure routing
def _random_routing(seed: int, num_tokens: int, num_experts: int, topk: int, drop: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand((num_tokens, num_experts), generator=g)
    idx = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros((num_tokens, num_experts), dtype=torch.bool).scatter_(1, idx, True)
    routing_map &= torch.rand((num_tokens, num_experts), generator=g) >= drop
    probs = torch.where(routing_map, scores.softmax(1), torch.zeros(()))
    return routing_map, probs


def test_routing_to_topk_keeps_selection_and_weights():
    routing_map, probs = _random_routing(1, 40, 8, 3, drop=0.3)
    probs.requires_grad_()
    topk_idx, topk_weights = routing_to_topk(routing_map, probs, 3)
    assert topk_idx.dtype == torch.int64 and topk_weights.dtype == torch.float32
    rebuilt = torch.zeros_like(routing_map)
    rows = torch.arange(40).unsqueeze(1).expand(-1, 3)
    valid = topk_idx >= 0
    rebuilt[rows[valid], topk_idx[valid]] = True
    assert torch.equal(rebuilt, routing_map)  # dropped entries (False in the map) became -1
    assert bool((topk_weights[~valid] == 0).all())
    assert torch.equal(topk_weights[valid], probs.detach()[rows[valid], topk_idx[valid]])  # gathered, exact
    topk_weights.sum().backward()
    assert torch.equal(probs.grad, routing_map.float())


def test_routing_to_topk_rejects_bad_arguments():
    routing_map, probs = _random_routing(2, 4, 8, 2)
    with pytest.raises(ValueError, match="routing_map: expected the shape of probs"):
        routing_to_topk(routing_map[:, :4], probs, 2)
    with pytest.raises(ValueError, match="topk: expected 1 <= topk <= num_experts=8, got 9"):
        routing_to_topk(routing_map, probs, 9)


def test_fold_tensor_parallel_layout():
    # 2 EP ranks x 2 local experts, TP=2: expert g of EP rank g//2 lives on TP x EP ranks 2*(g//2) + t.
    topk_idx = torch.tensor([[0, 3], [2, -1]])
    weights = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    folded, folded_w = fold_tensor_parallel(topk_idx, weights, num_local_experts=2, tp_size=2)
    assert folded.tolist() == [[0, 2, 5, 7], [4, 6, -1, -1]]
    assert folded_w.tolist() == [[0.25, 0.25, 0.75, 0.75], [1.0, 1.0, 0.0, 0.0]]
    same_idx, same_w = fold_tensor_parallel(topk_idx, weights, num_local_experts=2, tp_size=1)
    assert same_idx is topk_idx and same_w is weights


def test_expert_major_order_matches_brute_force():
    g = torch.Generator().manual_seed(3)
    recv_topk_idx = torch.randint(-1, 4, (30, 3), generator=g)
    for row in recv_topk_idx:  # a token picks an expert at most once
        seen = set()
        for j in range(3):
            if int(row[j]) in seen:
                row[j] = -1
            seen.add(int(row[j]))
    expected = [r * 3 + j for e in range(4) for r in range(30) for j in range(3) if int(recv_topk_idx[r, j]) == e]
    order = expert_major_order(recv_topk_idx, 4, len(expected))
    assert order.tolist() == expected


# ---------------------------------------------------------------------------------------------- config and install
def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    args = {
        "num_layers": 1,
        "hidden_size": HIDDEN,
        "num_attention_heads": 2,
        "num_moe_experts": NUM_EXPERTS,
        "moe_router_topk": TOPK,
        "moe_ffn_hidden_size": FFN,
        "use_cpu_initialization": True,
        "moe_aux_loss_coeff": 0.0,
        "add_bias_linear": False,
        "moe_token_dispatcher_type": "deepep",
    }
    args.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformerConfig(**args)


SHARED_OVERLAP = {"moe_shared_expert_intermediate_size": FFN, "moe_shared_expert_overlap": True}
# 0.16/0.17 allow moe_shared_expert_overlap with "alltoall" only, 0.18+ with "alltoall" or "flex".
SHARED_OVERLAP_REFUSED = "moe_shared_expert_overlap only works with alltoall"


def _flex_allows_shared_expert_overlap() -> bool:
    """Whether this megatron-core's own flex/deepep rules allow moe_shared_expert_overlap (0.18+). "deepep" is
    checked by the same rules, so it gets shared-expert overlap exactly where flex does."""
    try:
        _config(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep", **SHARED_OVERLAP)
    except ValueError as e:
        if SHARED_OVERLAP_REFUSED in str(e):
            return False
        raise
    return True


@requires_megatron
def test_config_accepts_deepep_with_overlap_options():
    from ep_dispatcher import megatron as plugin

    assert plugin.is_installed()
    if _flex_allows_shared_expert_overlap():
        assert _config(**SHARED_OVERLAP).moe_token_dispatcher_type == "deepep"
    else:
        with pytest.raises(ValueError, match=SHARED_OVERLAP_REFUSED):
            _config(**SHARED_OVERLAP)
    config = _config(overlap_moe_expert_parallel_comm=True, expert_model_parallel_size=2, bf16=True)
    assert config.moe_token_dispatcher_type == "deepep" and config.overlap_moe_expert_parallel_comm
    assert plugin.uses_ep_dispatcher(config)
    assert plugin.uses_ep_dispatcher(_config(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep"))
    assert not plugin.uses_ep_dispatcher(_config(moe_token_dispatcher_type="alltoall"))


@requires_megatron
def test_config_rejects_what_deepep_does_not_support():
    with pytest.raises(ValueError, match="does not support moe_pad_expert_input_to_capacity"):
        _config(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    # Megatron's own rules still apply to the flipped config (0.16/0.17 refuse shared-expert overlap earlier).
    expected = (
        (AssertionError, "disable moe_shared_expert_overlap")
        if _flex_allows_shared_expert_overlap()
        else (ValueError, SHARED_OVERLAP_REFUSED)
    )
    with pytest.raises(expected[0], match=expected[1]):
        _config(overlap_moe_expert_parallel_comm=True, expert_model_parallel_size=2, bf16=True, **SHARED_OVERLAP)


@requires_megatron
def test_uninstalled_megatron_rejects_deepep_overlap():
    from ep_dispatcher import megatron as plugin

    ep_overlap = {"overlap_moe_expert_parallel_comm": True, "expert_model_parallel_size": 2, "bf16": True}
    plugin.uninstall()
    try:
        with pytest.raises(ValueError, match=SHARED_OVERLAP_REFUSED):
            _config(**SHARED_OVERLAP)
        with pytest.raises(AssertionError, match="supported with alltoall/flex token dispatcher"):
            _config(**ep_overlap)
    finally:
        plugin.install()
    assert _config(**ep_overlap)
    if _flex_allows_shared_expert_overlap():
        assert _config(**SHARED_OVERLAP)


def _should_free_input():
    """Megatron's ``should_free_input`` (where the plugin found it) and the extra arguments it takes: 0.17+ add
    ``num_local_experts``, which 0.16 does not have."""
    from ep_dispatcher.megatron.install import _FREE_INPUT_MODULES

    for module_name in _FREE_INPUT_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        fn = getattr(module, "should_free_input", None)
        if fn is not None:
            takes_experts = "num_local_experts" in inspect.signature(fn).parameters
            return fn, (lambda n: (n,)) if takes_experts else (lambda n: ())
    raise AssertionError(f"should_free_input is in none of {_FREE_INPUT_MODULES}")


@requires_megatron
def test_should_free_input_follows_flex_deepep_policy():
    should_free_input, extra = _should_free_input()
    assert hasattr(should_free_input, "__ep_dispatcher_wrapped__")  # install() hooked the function the schedule calls
    ours = _config(expert_model_parallel_size=2)
    flex = _config(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep", expert_model_parallel_size=2)
    for name in ("pre_dispatch_computation", "moe_dispatch", "mlp", "moe_combine"):
        for num_local_experts in (1, 4):
            assert should_free_input(name, True, ours, *extra(num_local_experts)) == should_free_input(
                name, True, flex, *extra(num_local_experts)
            ), name
    # The dispatch node's input aliases the router's input: it must survive the forward.
    assert should_free_input("moe_dispatch", True, ours, *extra(4)) is False
    assert ours.moe_token_dispatcher_type == "deepep"  # restored after the query


def test_import_ep_dispatcher_never_imports_megatron():
    code = (
        "import sys; import ep_dispatcher; assert 'megatron' not in sys.modules; "
        "sys.modules['megatron'] = None; import ep_dispatcher.megatron as m; assert not m.is_installed(); "
        "from ep_dispatcher.megatron.routing import routing_to_topk\n"
        "try:\n    m.install()\nexcept ImportError as e:\n    assert 'megatron-core is not importable' in str(e)\n"
        "else:\n    raise SystemExit('install() without megatron must raise ImportError')"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------------------------------------- multi-rank workers
def _setup_rank(tp: int, ep: int) -> None:
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    import ep_dispatcher.megatron  # noqa: F401  (registers "deepep")
    from ep_dispatcher.megatron import cpu_shim

    cpu_shim.enable()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)


def _build_moe_layer(dispatcher_type: str, tp: int, ep: int, seed: int, **overrides):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    config = _config(
        moe_token_dispatcher_type=dispatcher_type,
        expert_model_parallel_size=ep,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        **overrides,
    )
    torch.manual_seed(seed)  # same seed on every rank and for both dispatchers: identical weights
    return get_moe_module_spec(use_te=False, num_experts=NUM_EXPERTS, moe_grouped_gemm=False)(config=config)


LAYER_CASES = {
    "softmax": {},
    "sigmoid_dropping": {"moe_router_score_function": "sigmoid", "moe_expert_capacity_factor": 0.5},
    "shared_expert": {"moe_shared_expert_intermediate_size": 24},
    "flex_deepep": {"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "deepep"},
}


def _run_layer(layer, rank: int, seed: int):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn((6, 2, HIDDEN), generator=g).requires_grad_()
    out, bias = layer(x)
    assert bias is None
    grad_out = torch.randn(out.shape, generator=g)
    out.backward(grad_out)
    return out.detach(), x.grad, {name: p.grad for name, p in layer.named_parameters()}


def _layer_worker(rank: int, world: int, tp: int, cases: list) -> dict:
    from ep_dispatcher.megatron import EPDispatcherTokenDispatcher

    ep = world // tp
    _setup_rank(tp, ep)
    worst = {}
    for seed, case in enumerate(cases):
        overrides = dict(LAYER_CASES[case])
        ours_type = overrides.pop("moe_token_dispatcher_type", "deepep")
        reference = _build_moe_layer(
            "allgather", tp, ep, seed, **{k: v for k, v in overrides.items() if k != "moe_flex_dispatcher_backend"}
        )
        ours = _build_moe_layer(ours_type, tp, ep, seed, **overrides)
        assert isinstance(ours.token_dispatcher, EPDispatcherTokenDispatcher), type(ours.token_dispatcher)
        ref_out, ref_dx, ref_grads = _run_layer(reference, rank, seed)
        out, dx, grads = _run_layer(ours, rank, seed)
        if case == "sigmoid_dropping":
            dropped = torch.tensor(int((ours.token_dispatcher.token_indices < 0).sum()))
            dist.all_reduce(dropped)
            assert int(dropped) > 0, "capacity factor 0.5 should drop tokens"
        torch.testing.assert_close(out, ref_out, rtol=LAYER_RTOL, atol=LAYER_ATOL)
        torch.testing.assert_close(dx, ref_dx, rtol=LAYER_RTOL, atol=LAYER_ATOL)
        assert ref_grads.keys() == grads.keys()
        for name in grads:
            assert grads[name] is not None, name
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=LAYER_RTOL, atol=LAYER_ATOL, msg=name)
        worst[case] = max(
            [float((out - ref_out).abs().max()), float((dx - ref_dx).abs().max())]
            + [float((grads[n] - ref_grads[n]).abs().max()) for n in grads]
        )
        if case == "softmax":
            _round_trip(ours.token_dispatcher, rank, tp)
    return worst


def _round_trip(dispatcher, rank: int, tp: int) -> None:
    """Megatron's dropless check: probs = 1/k, permute -> scale by the permuted probs -> unpermute == input; the
    gradient of sum(out * x) w.r.t. x is x again. With TP each TP rank gets a copy of each token, so both are tp x."""
    g = torch.Generator().manual_seed(77 + rank)
    x = torch.randn((12, 1, HIDDEN), generator=g).requires_grad_()
    routing_map, _ = _random_routing(5 + rank, 12, NUM_EXPERTS, TOPK)
    probs = routing_map.float() / TOPK
    tokens, token_probs = dispatcher.dispatch_preprocess(x, routing_map, probs)
    tokens, dispatched_probs = dispatcher.token_dispatch(tokens, token_probs)
    expert_input, tokens_per_expert, permuted_probs = dispatcher.dispatch_postprocess(tokens, dispatched_probs)
    assert tokens_per_expert.device.type == "cpu" and int(tokens_per_expert.sum()) == expert_input.size(0)
    restored = dispatcher.combine_postprocess(
        dispatcher.token_combine(dispatcher.combine_preprocess(expert_input * permuted_probs.unsqueeze(-1)))
    )
    torch.testing.assert_close(restored, x.detach() * tp, rtol=1e-6, atol=1e-6)  # k fp32 products summed
    restored.backward(x.detach())
    torch.testing.assert_close(x.grad, x.detach() * tp, rtol=1e-6, atol=1e-6)


@requires_megatron
def test_fused_permute_is_on_by_default():
    """The plugin dispatches straight into expert-major rows unless told otherwise (GPU-validated fused kernels)."""
    from ep_dispatcher.megatron import EPDispatcherTokenDispatcher

    assert EPDispatcherTokenDispatcher.fused_permute is True
    assert EPDispatcherTokenDispatcher.fixed_order_unpermute is False


@requires_megatron
@pytest.mark.parametrize(
    "world, tp, cases",
    [
        (2, 1, ["softmax", "sigmoid_dropping", "shared_expert", "flex_deepep"]),
        (4, 1, ["softmax", "sigmoid_dropping"]),
        (4, 2, ["softmax", "shared_expert"]),
    ],
    ids=["ep2", "ep4", "tp2xep2"],
)
def test_moe_layer_matches_allgather(world, tp, cases):
    results = run(_layer_worker, world, tp, cases)
    assert all(set(r) == set(cases) for r in results)


# ---------------------------------------------------------------------------------------------- EP overlap (1F1B)
class _NoEvent:
    """Stands in for torch.cuda.Event on CPU: work is already ordered (one stream), so record/wait are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def _single_stream_cuda_api() -> None:
    """The combined-1F1B schedule places nodes on a compute and a communication stream. On CPU both are "no stream"
    (``torch.cuda.stream(None)`` is a no-op context), so the schedule runs its nodes in its own order on one
    stream: what it decides (node order, detaching, freeing inputs) is exercised, the concurrency is not."""
    torch.cuda.Event = _NoEvent
    torch.cuda.Stream = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda *args, **kwargs: None
    record_stream = torch.Tensor.record_stream
    torch.Tensor.record_stream = lambda self, stream: None if stream is None else record_stream(self, stream)


def _build_gpt(dispatcher_type: str, ep: int, overlap: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = _config(
        moe_token_dispatcher_type=dispatcher_type,
        expert_model_parallel_size=ep,
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        bf16=True,
        overlap_moe_expert_parallel_comm=overlap,
        masked_softmax_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        moe_aux_loss_coeff=0.0,
    )
    torch.manual_seed(0)
    spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPTModel(config, spec, vocab_size=64, max_sequence_length=16).bfloat16()


def _overlap_worker(rank: int, world: int, fused_permute: bool = False) -> float:
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan as Plan
    from megatron.core.pipeline_parallel.utils import set_streams

    from ep_dispatcher.megatron import EPDispatcherTokenDispatcher

    EPDispatcherTokenDispatcher.fused_permute = fused_permute  # this process only (a spawned rank)
    _setup_rank(1, world)
    _single_stream_cuda_api()
    set_streams()
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(2)]
    position_ids = torch.arange(16).expand(2, 16)
    attention_mask = torch.tril(torch.ones(1, 1, 16, 16)) < 0.5
    results = {}
    for mode in ("allgather", "plain", "overlap"):
        model = _build_gpt("allgather" if mode == "allgather" else "deepep", world, overlap=mode == "overlap")
        if mode == "overlap":
            # 1F1B: forward(mb0); forward(mb1) interleaved with backward(mb0); backward(mb1).
            plan0 = model.build_schedule_plan(batches[0], position_ids, attention_mask, labels=batches[0])
            loss0 = Plan.run(plan0, None)
            plan1 = model.build_schedule_plan(batches[1], position_ids, attention_mask, labels=batches[1])
            loss1 = Plan.run(plan1, plan0, b_grad=torch.ones_like(loss0))
            Plan.run(None, plan1, b_grad=torch.ones_like(loss1))
            losses = [loss0, loss1]
        else:
            losses = []
            for ids in batches:
                loss = model(ids, position_ids, attention_mask, labels=ids)
                loss.float().sum().backward()
                losses.append(loss)
        results[mode] = ([t.detach().float() for t in losses], {n: p.grad for n, p in model.named_parameters()})
    (ref_losses, _), (plain_losses, plain_grads), (losses, grads) = (
        results["allgather"],
        results["plain"],
        results["overlap"],
    )
    for a, b in zip(plain_losses, ref_losses):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # same bf16 ops in the same order as allgather (observed)
    # The schedule reorders micro-batches, not the ops inside one: losses and gradients are bit-identical.
    for a, b in zip(losses, plain_losses):
        assert torch.equal(a, b)
    for name, grad in grads.items():
        assert grad is not None and plain_grads[name] is not None, name
        assert torch.equal(grad, plain_grads[name]), name
    return float(sum(t.sum() for t in losses))


@requires_megatron
@pytest.mark.parametrize("fused_permute", [True, False], ids=["fused_permute", "unfused_permute"])
def test_ep_overlap_combined_1f1b_matches_plain_schedule(fused_permute):
    run(_overlap_worker, 2, fused_permute)


# ---------------------------------------------------------------------------------------------- fused permute
FUSED_CASES = {
    "bf16_top4": {"moe_router_topk": 4, "bf16": True, "params_dtype": torch.bfloat16},
    "fp32_dropping": {"moe_router_score_function": "sigmoid", "moe_expert_capacity_factor": 0.5},
    "shared_expert": {"moe_shared_expert_intermediate_size": 24},
}


def _fused_permute_worker(rank: int, world: int, tp: int, cases: list) -> None:
    """The plugin with the fused permute (dispatch into expert-major rows, combine from them) against the same
    plugin with separate permute / un-permute passes: outputs and every gradient bit-identical."""
    from ep_dispatcher.megatron import EPDispatcherTokenDispatcher

    _setup_rank(tp, world // tp)
    for seed, case in enumerate(cases):
        results = {}
        defaults = (EPDispatcherTokenDispatcher.fused_permute, EPDispatcherTokenDispatcher.fixed_order_unpermute)
        for fused in (True, False):
            EPDispatcherTokenDispatcher.fused_permute = fused
            EPDispatcherTokenDispatcher.fixed_order_unpermute = not fused  # the fused path's arithmetic, unfused
            try:
                layer = _build_moe_layer("deepep", tp, world // tp, seed, **FUSED_CASES[case])
                if case == "bf16_top4":
                    layer = layer.bfloat16()
                g = torch.Generator().manual_seed(seed * 1000 + rank)
                x = torch.randn((6, 2, HIDDEN), generator=g).to(layer.router.weight.dtype).requires_grad_()
                out, _ = layer(x)
                out.backward(torch.randn(out.shape, generator=g).to(out.dtype))
                results[fused] = (out.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()})
            finally:
                EPDispatcherTokenDispatcher.fused_permute = defaults[0]
                EPDispatcherTokenDispatcher.fixed_order_unpermute = defaults[1]
        (out_f, dx_f, grads_f), (out_u, dx_u, grads_u) = results[True], results[False]
        assert torch.equal(out_f, out_u), case
        assert torch.equal(dx_f, dx_u), case
        assert grads_f.keys() == grads_u.keys()
        for name in grads_f:
            assert grads_f[name] is not None and torch.equal(grads_f[name], grads_u[name]), (case, name)


@requires_megatron
@pytest.mark.parametrize(
    "world, tp, cases",
    [(2, 1, ["bf16_top4", "fp32_dropping", "shared_expert"]), (4, 1, ["bf16_top4"]), (4, 2, ["bf16_top4"])],
    ids=["ep2", "ep4", "tp2xep2"],
)
def test_fused_permute_matches_unfused(world, tp, cases):
    run(_fused_permute_worker, world, tp, cases)
