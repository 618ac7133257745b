"""Decode step time with and without dual-batch overlap (DBO), per decode batch size: the layer stack and both paths
of examples/dbo_decode.py, at several token counts per rank.

    python benchmarks/bench_dbo.py --device cpu --ranks 2 --hidden 256 --experts 16 --topk 4 --out /tmp/bench_dbo.json
    python benchmarks/bench_dbo.py --device cuda --ranks 4 --tokens 64,128,256 --out bench_dbo.json
    python benchmarks/bench_dbo.py --device cuda --ranks 4 --tokens 64,128,256 --graph   # CUDA-graph replays

Per token count: the median wall-clock step (device synchronised at both ends, ranks aligned by a barrier) of the
plain path (one micro-batch) and the overlapped one (two), taking the slowest rank; tokens/s over all ranks; the
ratio plain / overlapped (> 1: DBO is faster); and the largest output difference, which must be exactly 0.
With --graph each path's step is captured once in a CUDA graph and the replays are timed: GPU time without the
Python and launch cost that bounds eager decode steps.
Process group: NCCL with one GPU per rank; gloo on CPU and when several ranks share one GPU. Low-latency calls that
have no CUDA kernel in this build run the reference path, which stages through host memory and syncs with the host:
there the overlap has little to hide behind, and the header says which calls were kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "examples")]  # run from a checkout; the example is the model

import dbo_decode as example  # noqa: E402

from ep_dispatcher.launch import spawn  # noqa: E402

# Decode-like shapes (DeepSeek's hidden 7168 and 256 experts scaled down so N ranks fit one GPU and the CPU test).
BENCH_DEFAULTS = dict(hidden=2048, ffn=256, experts=32, topk=8, layers=4, steps=20, warmup=3)


def _token_counts(text: str) -> list[int]:
    counts = [int(t) for t in text.split(",") if t.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return counts


def _worker(rank: int, world: int, args) -> dict:
    # One Buffer sized for the largest count serves every count (NVSHMEM's heap is sized once per process).
    example.select_device(rank, args)
    buffer = example.make_buffer(args, world, max(args.tokens))
    results = {tokens: example.rank_main(rank, world, _at(args, tokens), buffer) for tokens in args.tokens}
    engine_calls = list(buffer.engine_calls)
    buffer.destroy()  # collective (barrier first); rank_main synchronised the device after the last step
    return {"per_tokens": results, "engine_calls": engine_calls}


def _at(args, tokens: int) -> argparse.Namespace:
    """The example's arguments for one token count."""
    return argparse.Namespace(**{**vars(args), "tokens": tokens})


def _summarise(args, results: list[dict]) -> dict:
    r0 = results[0]["per_tokens"][args.tokens[0]]
    summary = {
        "args": vars(args),
        "process_group": r0["pg"],
        "devices": sorted({r["per_tokens"][args.tokens[0]]["device"] for r in results}),
        "buffer_backend": r0["backend"],
        "engine_calls": results[0]["engine_calls"],
        "timing": r0["timing"],  # "eager" or "graph" (--graph: CUDA-graph replays, no Python or launch cost)
        "per_tokens": {},
    }
    for tokens in args.tokens:
        runs = [r["per_tokens"][tokens] for r in results]
        plain_s = max(r["step_s"]["plain"] for r in runs)  # a step ends when the slowest rank ends
        overlap_s = max(r["step_s"]["overlap"] for r in runs)
        summary["per_tokens"][str(tokens)] = {
            "plain_ms": plain_s * 1e3,
            "overlap_ms": overlap_s * 1e3,
            "plain_tokens_per_s": args.ranks * tokens / plain_s,
            "overlap_tokens_per_s": args.ranks * tokens / overlap_s,
            "speedup": plain_s / overlap_s,
            "max_diff": max(r["max_diff"] for r in runs),
        }
    summary["max_diff"] = max(row["max_diff"] for row in summary["per_tokens"].values())
    summary["ok"] = summary["max_diff"] == 0.0
    return summary


def _print(args, s: dict) -> None:
    print(
        f"bench_dbo: {args.ranks} ranks on {', '.join(s['devices'])} ({s['process_group']} process group), "
        f"{args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts top-{args.topk}, "
        f"{'FP8' if args.fp8 else 'BF16'} dispatch; steps timed "
        f"{'as CUDA-graph replays (GPU time, no Python or launches)' if s['timing'] == 'graph' else 'eagerly'}"
    )
    print(f"  Buffer backend={s['buffer_backend']}, CUDA kernels for {s['engine_calls']} (other calls: reference path)")
    print(
        f"  plain = 1 micro-batch, overlap = {args.micro_batches} micro-batches; median of {args.steps} steps after "
        f"{args.warmup} warm-up, slowest rank; speedup = plain / overlap"
    )
    print(
        f"  {'tokens/rank':>11s} {'plain ms':>9s} {'overlap ms':>10s} {'plain tok/s':>12s} {'overlap tok/s':>13s} "
        f"{'speedup':>7s} {'max diff':>9s}"
    )
    for tokens, row in s["per_tokens"].items():
        print(
            f"  {tokens:>11s} {row['plain_ms']:9.2f} {row['overlap_ms']:10.2f} {row['plain_tokens_per_s']:12.0f} "
            f"{row['overlap_tokens_per_s']:13.0f} {row['speedup']:6.2f}x {row['max_diff']:9.1e}"
        )
    verdict = "OK" if s["ok"] else "FAIL"
    print(f"max |overlap - plain| over all token counts: {s['max_diff']:.3e} (must be exactly 0) -> {verdict}")


def main(argv: list[str] | None = None) -> int:
    # Every option of the example (shapes, --micro-batches, --backend, --pg-backend, ...) plus a list of --tokens.
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], parents=[example.build_parser()], conflict_handler="resolve"
    )
    parser.set_defaults(**BENCH_DEFAULTS)
    parser.add_argument(
        "--tokens", type=_token_counts, default=[64, 128, 256], help="decode tokens per rank, comma-separated"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    for tokens in args.tokens:
        example.check_args(parser, _at(args, tokens))
    summary = _summarise(args, spawn(_worker, args.ranks, args, backend=example.process_group_backend(args)))
    _print(args, summary)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
