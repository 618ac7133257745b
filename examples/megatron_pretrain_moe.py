"""Train a tiny GPT-MoE (megatron.core GPTModel) for a few steps with moe_token_dispatcher_type="deepep"
(ep_dispatcher) and again with Megatron's "allgather" dispatcher, from the same weights and data; print both
losses per step and the largest difference.

    python examples/megatron_pretrain_moe.py                    # 2 ranks; gloo on CPU, NCCL with one GPU per rank
    python examples/megatron_pretrain_moe.py --ranks 4 --steps 10 --hidden 128 --experts 16 --topk 4

Expert parallelism spans all ranks (EP = --ranks, TP = 1); the dense weights are data-parallel over the same ranks.
Exits with status 1 if the two runs differ by more than --tolerance.

    python examples/megatron_pretrain_moe.py --flex-switch      # issue 20: Megatron's own flex dispatcher on DeepEP

With --flex-switch the second run is instead Megatron-core's own flex dispatcher (moe_token_dispatcher_type="flex",
moe_flex_dispatcher_backend="deepep", its fused_a2a.py calling `deep_ep`) on ep_dispatcher through
ep_dispatcher.install_as_deep_ep() alone (our plugin uninstalled for that run), compared with our plugin's path.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from ep_dispatcher.launch import spawn

DEFAULT_TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2}  # fp32: summation order only; bf16: rounding of the 2-way sums


FLEX_SWITCH = "flex"  # Megatron's own flex dispatcher through install_as_deep_ep()


def _with_grouped_experts(moe_spec):
    """The MoE layer's spec with examples/torch_grouped_experts.py's experts in place of SequentialMLP."""
    folder = os.path.dirname(os.path.abspath(__file__))  # this example's, which holds the module
    if folder not in sys.path:  # build_model runs once per dispatcher: add it once
        sys.path.insert(0, folder)
    from torch_grouped_experts import TorchGroupedMLP

    if isinstance(moe_spec, functools.partial):  # newer megatron-core: partial(MoELayer, submodules=MoESubmodules)
        submodules = dataclasses.replace(moe_spec.keywords["submodules"], experts=TorchGroupedMLP)
        return functools.partial(moe_spec.func, *moe_spec.args, **{**moe_spec.keywords, "submodules": submodules})
    from megatron.core.transformer.spec_utils import ModuleSpec  # older: ModuleSpec(MoELayer, MoESubmodules)

    moe_spec.submodules.experts = ModuleSpec(module=TorchGroupedMLP)
    return moe_spec


def build_model(args, dispatcher_type: str, ep_rank: int, device: torch.device):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    bf16 = args.dtype == "bf16"
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        # None: Megatron's default, hidden / heads.
        **({"kv_channels": args.kv_channels} if getattr(args, "kv_channels", None) else {}),
        ffn_hidden_size=2 * args.hidden,
        num_moe_experts=args.experts,
        moe_router_topk=args.topk,
        moe_ffn_hidden_size=getattr(args, "moe_ffn", None) or args.hidden,
        moe_token_dispatcher_type=dispatcher_type,
        **({"moe_flex_dispatcher_backend": "deepep"} if dispatcher_type == FLEX_SWITCH else {}),
        expert_model_parallel_size=args.ranks,
        moe_aux_loss_coeff=1e-2,
        moe_router_dtype="fp32",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_cpu_initialization=True,
    )
    torch.manual_seed(args.seed)  # same dense weights on every rank and for both dispatchers
    layer_spec = get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=False)
    if getattr(args, "expert_impl", "sequential") == "grouped":
        layer_spec.submodules.mlp = _with_grouped_experts(layer_spec.submodules.mlp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPTModel(
            config,
            layer_spec,
            vocab_size=args.vocab,
            max_sequence_length=args.seq,
        )
    # Experts differ between EP ranks (each rank holds different experts): re-draw them from a per-rank seed.
    generator = torch.Generator().manual_seed(args.seed + 1000 + ep_rank)
    with torch.no_grad():
        for _, param in model.named_parameters():
            if not getattr(param, "allreduce", True):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    model = model.to(device)
    return model.bfloat16() if bf16 else model


def _sync_grads(model) -> None:
    """Average gradients like Megatron's DDP: dense weights over the data-parallel group, experts over the
    expert-data-parallel group (size world / EP). One all-reduce per group and dtype over the flattened gradients, as
    DDP's buckets: per-parameter calls cost a collective each (on gloo with CUDA tensors, two copies each)."""
    from megatron.core import parallel_state

    dense_group = parallel_state.get_data_parallel_group()
    expert_group = parallel_state.get_expert_data_parallel_group()
    buckets: dict = {}
    for param in model.parameters():
        if param.grad is None:
            continue
        group = dense_group if getattr(param, "allreduce", True) else expert_group
        if dist.get_world_size(group) > 1:
            buckets.setdefault((id(group), param.grad.dtype), (group, []))[1].append(param.grad)
    for group, grads in buckets.values():
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group)
        flat.div_(dist.get_world_size(group))
        for grad, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(
    args,
    dispatcher_type: str,
    rank: int,
    device: torch.device,
    step_times: list | None = None,
    on_model=None,
    on_step=None,
    allreduce_times: list | None = None,
) -> list[float]:
    """Train ``args.steps`` steps; returns the global mean loss per step. With ``step_times``, appends each step's
    wall time in seconds (forward, backward, gradient all-reduce, Adam; the device synchronised at both ends). With
    ``allreduce_times``, appends the gradient all-reduce's share of it (the device synchronised before it too).
    ``on_model(model)`` runs once after the model is built (benchmarks wrap its token dispatchers there);
    ``on_step(step)`` after each step, once the device is synchronised."""
    from megatron.core import parallel_state

    model = build_model(args, dispatcher_type, parallel_state.get_expert_model_parallel_rank(), device)
    if on_model is not None:
        on_model(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    position_ids = torch.arange(args.seq, device=device).expand(args.batch, args.seq)
    attention_mask = torch.triu(torch.ones(1, 1, args.seq, args.seq, device=device, dtype=torch.bool), diagonal=1)
    losses = []
    for step in range(args.steps):
        generator = torch.Generator().manual_seed(args.seed * 7919 + step * 131 + rank)  # each rank its own data
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator).to(device)
        input_ids, labels = tokens[:, :-1], tokens[:, 1:]
        _sync(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids, position_ids, attention_mask, labels=labels).float().mean()
        loss.backward()
        if allreduce_times is not None:
            _sync(device)
            allreduce_start = time.perf_counter()
        _sync_grads(model)
        if allreduce_times is not None:
            _sync(device)
            allreduce_times.append(time.perf_counter() - allreduce_start)
        optimizer.step()
        _sync(device)
        if step_times is not None:
            step_times.append(time.perf_counter() - start)
        if on_step is not None:
            on_step(step)
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(float(global_loss) / dist.get_world_size())
    return losses


DISPATCHERS = ("deepep", "allgather")


def second_label(args) -> str:
    """What the run compared with "deepep" is (its results keep the key "allgather")."""
    return "flex(switch)" if args.flex_switch else "allgather"


def train_second(args, rank: int, device: torch.device, step_times: list | None = None) -> list[float]:
    """The run compared with "deepep": Megatron's "allgather" dispatcher, or with --flex-switch Megatron's own
    flex/deepep dispatcher on ep_dispatcher through install_as_deep_ep() alone (our plugin uninstalled for it)."""
    if not args.flex_switch:
        return train(args, "allgather", rank, device, step_times)
    from megatron.core.transformer.moe import fused_a2a

    import ep_dispatcher
    from ep_dispatcher import megatron as plugin

    assert fused_a2a.HAVE_DEEP_EP, "install_as_deep_ep() must run before megatron-core imports fused_a2a"
    plugin.uninstall()
    try:
        losses = train(args, FLEX_SWITCH, rank, device, step_times)
    finally:
        plugin.install()
    assert isinstance(fused_a2a._buffer, ep_dispatcher.Buffer)  # Megatron's get_buffer made one of ours
    return losses


def setup_parallel(world: int, args, device: torch.device) -> None:
    """Register "deepep", make Megatron run on ``device`` (CPU patches when it is the CPU), EP = world, TP = 1."""
    from megatron.core import parallel_state

    import ep_dispatcher.megatron  # noqa: F401  (registers moe_token_dispatcher_type="deepep")
    from ep_dispatcher.megatron import cpu_shim

    if device.type == "cpu":
        cpu_shim.enable()
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(args.seed)


def train_both(rank: int, world: int, args, device: torch.device) -> dict:
    """EP = world on this rank; train with each of ``DISPATCHERS`` from the same weights and data.
    Returns ``{dispatcher: losses}``."""
    from megatron.core import parallel_state

    setup_parallel(world, args, device)
    results = {"deepep": train(args, "deepep", rank, device), "allgather": train_second(args, rank, device)}
    parallel_state.destroy_model_parallel()
    return results


def _worker(rank: int, world: int, args) -> dict:
    warnings.filterwarnings("ignore")
    if args.flex_switch:
        import ep_dispatcher

        ep_dispatcher.install_as_deep_ep()  # before megatron-core imports deep_ep
    on_gpu = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    return train_both(rank, world, args, device)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks = expert-parallel size")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument(
        "--kv-channels",
        type=int,
        default=None,
        help="attention width per head (default: hidden / heads); smaller makes the attention, and the dense "
        "gradients every data-parallel step all-reduces, smaller next to the experts",
    )
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--tolerance", type=float, default=None, help="max |loss difference| accepted")
    parser.add_argument(
        "--expert-impl",
        choices=("sequential", "grouped"),
        default="sequential",
        help="local experts: Megatron's SequentialMLP (a GEMM per expert, token counts read on the host) or "
        "examples/torch_grouped_experts.py (two torch._grouped_mm for all of them, no host sync)",
    )
    parser.add_argument(
        "--flex-switch",
        action="store_true",
        help="compare with Megatron's own flex/deepep dispatcher on ep_dispatcher via install_as_deep_ep()",
    )
    parser.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="process-group backend; auto = nccl when there is one GPU per rank, else gloo",
    )
    return parser


def check_args(parser: argparse.ArgumentParser, args) -> None:
    if args.experts % args.ranks != 0:
        parser.error(f"--experts ({args.experts}) must be a multiple of --ranks ({args.ranks})")


def process_group_backend(args) -> str:
    """``--backend``, where auto = NCCL with one GPU per rank, else gloo."""
    if args.backend != "auto":
        return args.backend
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= args.ranks else "gloo"


def tolerance(args) -> float:
    return args.tolerance if args.tolerance is not None else DEFAULT_TOLERANCE[args.dtype]


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    backend = process_group_backend(args)
    max_allowed = tolerance(args)

    results = spawn(_worker, args.ranks, args, backend=backend)[0]
    deepep, allgather = results["deepep"], results["allgather"]
    print(
        f"GPT-MoE: {args.layers} layers, hidden {args.hidden}, {args.experts} experts top-{args.topk}, "
        f"EP={args.ranks} ({backend}), {args.dtype}"
    )
    other = second_label(args)
    print(f"{'step':>4}  {'loss deepep':>14}  {'loss ' + other:>14}  {'|diff|':>10}")
    for step, (a, b) in enumerate(zip(deepep, allgather)):
        print(f"{step:>4}  {a:>14.8f}  {b:>14.8f}  {abs(a - b):>10.3e}")
    max_diff = max(abs(a - b) for a, b in zip(deepep, allgather))
    ok = max_diff <= max_allowed
    print(f"max |loss difference| = {max_diff:.3e} (tolerance {max_allowed:.1e}): {'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
