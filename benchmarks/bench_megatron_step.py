"""Step time of a small Megatron-core GPT-MoE training step: moe_token_dispatcher_type="deepep" (ep_dispatcher)
versus Megatron's own "allgather" dispatcher, same weights and data (the model and training step of
examples/megatron_pretrain_moe.py).

    python benchmarks/bench_megatron_step.py --device cpu --ranks 2 --out /tmp/bench_megatron.json
    python benchmarks/bench_megatron_step.py --device cuda --ranks 2 --hidden 1024 --experts 16 --topk 4 \\
        --seq 1024 --tokens 4096 --dtype bf16 --out bench_megatron.json

A step is forward, backward, gradient all-reduce and Adam, timed on the wall clock with the device synchronised at
both ends; the table shows the median over --steps steps after --warmup, taking the slowest rank of each step.
Process group: NCCL with one GPU per rank; gloo on CPU and when several ranks share one GPU (NCCL refuses that).
gloo has no CUDA all_gather_into_tensor / reduce_scatter_tensor, which Megatron's allgather dispatcher calls, so in
that case this script stages those calls through host memory (see ``enable_host_staging``) and says so: that makes
the allgather baseline slower than it would be on NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings
from collections import Counter

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "examples")]  # run from a checkout; the example is the model

import megatron_pretrain_moe as example  # noqa: E402

from ep_dispatcher.launch import spawn  # noqa: E402

STAGED_COLLECTIVES = ("all_gather_into_tensor", "_all_gather_base", "reduce_scatter_tensor", "_reduce_scatter_base")
staged_calls: Counter = Counter()  # per process: how many collectives went through the host


class _CompletedWork:
    """What an ``async_op=True`` caller gets from a staged collective: it already ran synchronously."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _host_staged(name: str, collective, always: bool):
    """``collective(output, input, ...)`` that, for CUDA tensors on a gloo group (any tensor if ``always``), copies
    the input to the host, runs there and copies the result back; anything else goes to ``collective`` unchanged."""

    def staged(output, input_, *args, group=None, async_op=False, **kwargs):
        if not (always or (output.is_cuda and dist.get_backend(group) == "gloo")):
            return collective(output, input_, *args, group=group, async_op=async_op, **kwargs)
        staged_calls[name] += 1
        host_output = torch.empty_like(output, device="cpu")
        collective(host_output, input_.cpu(), *args, group=group, **kwargs)
        output.copy_(host_output)
        return _CompletedWork() if async_op else None

    return staged


def enable_host_staging(always: bool = False) -> None:
    """Route ``STAGED_COLLECTIVES`` through ``_host_staged`` in this process: in ``torch.distributed`` (modules
    imported later pick them up) and in the megatron modules that already hold their own alias (e.g.
    ``tensor_parallel.mappings.dist_all_gather_func``). gloo does all-reduce / all-gather lists of CUDA tensors
    itself, so those stay as they are. ``always`` stages CPU tensors too (to test the shim on CPU)."""
    import megatron.core.tensor_parallel.mappings  # noqa: F401  (binds the aliases the allgather dispatcher calls)

    replacement = {}
    for name in STAGED_COLLECTIVES:
        original = getattr(dist, name)
        replacement[id(original)] = _host_staged(name, original, always)
        setattr(dist, name, replacement[id(original)])
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("megatron.") and module is not None:
            for attr, value in list(vars(module).items()):
                if id(value) in replacement:
                    setattr(module, attr, replacement[id(value)])


def _rank_device(rank: int, args) -> torch.device:
    if args.device == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())  # one GPU: every rank on cuda:0
    torch.cuda.set_device(device)
    return device


def _buffer_info() -> dict:
    from ep_dispatcher.megatron import buffer_cache

    buffers = list(buffer_cache.cache.buffers.values())  # the Buffer the "deepep" layers used (one per group)
    if not buffers:
        return {"backend": None, "engine_calls": []}
    return {"backend": buffers[0].backend, "engine_calls": list(buffers[0].engine_calls)}


def _worker(rank: int, world: int, args) -> dict:
    warnings.filterwarnings("ignore")
    if args.flex_switch:
        import ep_dispatcher

        ep_dispatcher.install_as_deep_ep()  # before megatron-core imports deep_ep
    from megatron.core import parallel_state

    device = _rank_device(rank, args)
    shim = args.host_staging == "always" or (
        args.host_staging == "auto" and device.type == "cuda" and dist.get_backend() == "gloo"
    )
    if shim:
        enable_host_staging(always=args.host_staging == "always")
    example.setup_parallel(world, args, device)
    run_args = argparse.Namespace(**{**vars(args), "steps": args.warmup + args.steps})
    result: dict = {"device": str(device), "pg": dist.get_backend(), "shim": shim, "runs": {}}
    for name in example.DISPATCHERS:
        staged_calls.clear()
        step_s: list[float] = []
        if name == "deepep":
            losses = example.train(run_args, name, rank, device, step_s)
        else:
            losses = example.train_second(run_args, rank, device, step_s)
        result["runs"][name] = {"losses": losses, "step_s": step_s, "staged_calls": dict(staged_calls)}
    result["buffer"] = _buffer_info()
    parallel_state.destroy_model_parallel()
    return result


def _summarise(args, results: list[dict]) -> dict:
    """Per dispatcher: median over timed steps of the slowest rank's step time, tokens/s over all ranks."""
    tokens_per_step = args.ranks * args.tokens
    r0 = results[0]
    summary: dict = {"args": vars(args), "process_group": r0["pg"], "host_staging": r0["shim"]}
    summary["devices"] = sorted({r["device"] for r in results})
    summary["buffer"] = r0["buffer"]
    summary["tokens_per_step"] = tokens_per_step
    summary["dispatchers"] = {}
    for name in example.DISPATCHERS:
        slowest = [max(r["runs"][name]["step_s"][i] for r in results) for i in range(args.warmup + args.steps)]
        median_s = statistics.median(slowest[args.warmup :])
        summary["dispatchers"][name] = {
            "median_step_ms": median_s * 1e3,
            "tokens_per_s": tokens_per_step / median_s,
            "step_ms": [t * 1e3 for t in slowest],
            "losses": r0["runs"][name]["losses"],
            "staged_calls_per_step": {
                op: n / (args.warmup + args.steps) for op, n in r0["runs"][name]["staged_calls"].items()
            },
        }
    deepep, allgather = (summary["dispatchers"][n]["losses"] for n in example.DISPATCHERS)
    summary["loss_diff_per_step"] = [abs(a - b) for a, b in zip(deepep, allgather)]
    summary["max_loss_diff"] = max(summary["loss_diff_per_step"])
    summary["tolerance"] = example.tolerance(args)
    summary["ok"] = summary["max_loss_diff"] <= summary["tolerance"]
    return summary


def _print(args, s: dict) -> None:
    print(
        f"bench_megatron_step: GPT-MoE training step, {args.layers} layers, hidden {args.hidden}, {args.experts} "
        f"experts top-{args.topk}, EP={args.ranks}, {args.tokens} tokens/rank (seq {args.seq} x {args.batch}), "
        f"{args.dtype}; {args.ranks} ranks on {', '.join(s['devices'])}, "
        f"{s['process_group']} process group"
    )
    buffer = s["buffer"]
    print(f"  deepep: ep_dispatcher Buffer backend={buffer['backend']}, CUDA kernels for {buffer['engine_calls']}")
    if s["process_group"] == "gloo" and args.device == "cuda":
        print("  (calls without a kernel run the reference path: all_to_all over gloo, staged through host memory)")
    if s["host_staging"] and args.device == "cpu":
        print("  allgather: --host-staging always: its all-gathers/reduce-scatters go through the host-staging shim")
    elif s["host_staging"]:
        print(
            "  allgather: gloo has no CUDA all_gather_into_tensor/reduce_scatter_tensor, so THIS RUN STAGES THEM\n"
            "  THROUGH HOST MEMORY (device->host copy, gloo on CPU, host->device copy): the allgather baseline is\n"
            "  slower than Megatron's allgather on NCCL; the ratio below is not a speed-up over an NCCL setup"
        )
    if args.device == "cpu":
        print("  CPU run: both dispatchers' collectives are gloo on host tensors; CPU timings say nothing about GPUs")
    print(
        f"  step = forward + backward + gradient all-reduce + Adam; median of {args.steps} steps after {args.warmup} "
        "warm-up, slowest rank per step"
    )
    print(f"  {'dispatcher':10s} {'step ms':>10s} {'tokens/s':>12s}  staged collectives per step")
    for name, d in s["dispatchers"].items():
        staged = ", ".join(f"{op} {n:g}" for op, n in d["staged_calls_per_step"].items()) or "-"
        print(f"  {name:10s} {d['median_step_ms']:10.2f} {d['tokens_per_s']:12.0f}  {staged}")
    other = example.second_label(args)
    if args.flex_switch:
        print("  allgather row = Megatron's own flex/deepep dispatcher on ep_dispatcher via install_as_deep_ep()")
    ratio = s["dispatchers"]["allgather"]["median_step_ms"] / s["dispatchers"]["deepep"]["median_step_ms"]
    print(f"  {other} / deepep step time: {ratio:.2f}x")
    print(
        f"  max |loss deepep - loss {other}| over {len(s['loss_diff_per_step'])} steps: {s['max_loss_diff']:.3e} "
        f"(tolerance {s['tolerance']:.1e}) -> {'OK' if s['ok'] else 'MISMATCH'}"
    )


def main(argv=None) -> int:
    # Every option of the example (shapes, --seq, --dtype, --backend = process group, ...) plus the timing ones.
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], parents=[example.build_parser()], conflict_handler="resolve"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--tokens", type=int, default=64, help="tokens per rank per step = --seq x micro-batch (sets --batch)"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--host-staging",
        choices=("auto", "always", "never"),
        default="auto",
        help="stage all_gather_into_tensor/reduce_scatter_tensor through host memory: auto = for CUDA tensors on "
        "gloo (one GPU, several ranks); always = on CPU too (tests the shim); never = leave them to gloo",
    )
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    example.check_args(parser, args)
    if args.tokens % args.seq != 0:
        parser.error(f"--tokens ({args.tokens}) must be a multiple of --seq ({args.seq})")
    args.batch = args.tokens // args.seq
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    if args.device == "cpu":
        # Megatron's CPU patches apply only when no GPU is visible (the ranks inherit this environment).
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        args.backend = "gloo"
    pg_backend = example.process_group_backend(args)
    if args.host_staging == "always" and pg_backend != "gloo":
        parser.error(f"--host-staging always needs a gloo process group, got {pg_backend}")
    summary = _summarise(args, spawn(_worker, args.ranks, args, backend=pg_backend))
    _print(args, summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
