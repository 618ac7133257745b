"""Decode steps of a small MoE decoder stack, with and without dual-batch overlap (DBO).

    python examples/dbo_decode.py                        # 2 ranks; gloo on CPU, NCCL with one GPU per rank
    python examples/dbo_decode.py --ranks 4 --tokens 64 --layers 4

Each layer (DeepSeek-like shapes, scaled down; random weights): an attention stand-in (RMS norm and one matmul,
residual), a softmax router with top-k, FP8 ``Buffer.low_latency_dispatch``, per-expert SwiGLU MLPs on the
expert-major buffer, weighted ``Buffer.low_latency_combine``, residual. The plain path runs the whole decode batch
as one micro-batch; the overlapped path splits it in two and runs both through ``MicroBatchOverlap``, so one
micro-batch's dispatch/combine is in flight while the other computes.

Same math per token: every operation is row-wise (norm, router, top-k, FP8 cast, combine's fixed-order weighted
sum) except the matmuls, and every matmul runs at a fixed shape in both paths (the dense ones on a
``[max_tokens, hidden]`` buffer, as CUDA-graph decode does; the experts on the low-latency layout
``[local_experts, ranks * max_tokens, hidden]``), so each token's output must be bit-identical. The script checks
it: the largest difference is printed and any non-zero value fails the run (exit code 1).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a source checkout

from ep_dispatcher import Buffer
from ep_dispatcher.dbo import YIELD, MicroBatchOverlap, Recv, Send
from ep_dispatcher.launch import spawn

FP8_GROUP = 128  # channels per FP8 scale (the low-latency kernels' cast)
RMS_EPS = 1e-6


def make_params(args, rank: int, world: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Per layer: ``attn [H, H]``, ``gate [H, E]``, and this rank's experts ``w13 [E_local, H, 2F]``,
    ``w2 [E_local, F, H]`` (fp32). Same seed on every rank: each rank slices its own experts."""
    g = torch.Generator().manual_seed(args.seed)
    h, f, e, local = args.hidden, args.ffn, args.experts, args.experts // world
    layers = []
    for _ in range(args.layers):
        attn = torch.randn((h, h), generator=g) * h**-0.5
        gate = torch.randn((h, e), generator=g) * h**-0.5
        w13 = torch.randn((e, h, 2 * f), generator=g) * h**-0.5
        w2 = torch.randn((e, f, h), generator=g) * f**-0.5
        layers.append(
            {
                "attn": attn,
                "gate": gate,
                "w13": w13[rank * local : (rank + 1) * local].contiguous(),
                "w2": w2[rank * local : (rank + 1) * local].contiguous(),
            }
        )
    return [{k: v.to(device) for k, v in layer.items()} for layer in layers]


def layer_stages(params: dict[str, torch.Tensor], buffer: Buffer, args) -> list:
    """The stages of one layer. A state is a dict; ``state["x"]``: ``[num_tokens, hidden] bfloat16``."""
    max_tokens = args.tokens

    def attention(state: dict) -> None:
        x = state["x"]
        n = x.size(0)
        padded = x.new_zeros((max_tokens, x.size(1)))  # fixed GEMM shape, whatever the micro-batch size
        padded[:n] = x
        xf = padded.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_EPS)
        h = (xf + normed @ params["attn"]).to(torch.bfloat16)
        probs = torch.softmax(h.float() @ params["gate"], dim=-1)
        weights, idx = probs.topk(args.topk, dim=-1)
        state["h"] = h[:n]
        state["topk_idx"] = idx[:n].contiguous()
        state["topk_weights"] = (weights / weights.sum(-1, keepdim=True))[:n].contiguous()

    def dispatch_send(state: dict):
        recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(
            state["h"], state["topk_idx"], max_tokens, args.experts, use_fp8=args.fp8, return_recv_hook=True
        )
        state.update(recv_x=recv_x, recv_count=recv_count, handle=handle)
        return hook

    def experts(state: dict) -> None:
        recv_x = state.pop("recv_x")
        if args.fp8:
            data, scales = recv_x
            e_local, slots, hidden = data.shape
            x = data.float().view(e_local, slots, hidden // FP8_GROUP, FP8_GROUP) * scales.unsqueeze(-1)
            x = x.view(e_local, slots, hidden)
        else:
            x = recv_x.float()
        # All slots are computed (no host-side count, CUDA-graph friendly); combine reads the valid ones only.
        gate_up = torch.bmm(x, params["w13"])
        gate, up = gate_up.chunk(2, dim=-1)
        state["expert_out"] = torch.bmm(torch.nn.functional.silu(gate) * up, params["w2"]).to(torch.bfloat16)

    def combine_send(state: dict):
        out, _, hook = buffer.low_latency_combine(
            state.pop("expert_out"),
            state["topk_idx"],
            state["topk_weights"],
            state.pop("handle"),
            return_recv_hook=True,
        )
        state["moe_out"] = out
        return hook

    def residual(state: dict) -> None:
        state["x"] = (state.pop("h").float() + state.pop("moe_out").float()).to(torch.bfloat16)

    # A YIELD right after each send: that send's transfer overlaps the other micro-batch's next segment.
    return [
        attention,
        Send("dispatch", dispatch_send),
        YIELD,
        Recv("dispatch"),
        experts,
        Send("combine", combine_send),
        YIELD,
        Recv("combine"),
        residual,
    ]


def build_stages(layers: list[dict[str, torch.Tensor]], buffer: Buffer, args) -> list:
    stages: list = []
    for params in layers:
        stages += layer_stages(params, buffer, args)  # residual and the next attention share one segment
    return stages


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def select_device(rank: int, args) -> torch.device:
    """This rank's device, made current: ranks share the GPUs round-robin (all on cuda:0 when there is one GPU)."""
    if torch.cuda.is_available() and args.device != "cpu":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def make_buffer(args, world: int, max_tokens: int) -> Buffer:
    """A low-latency ``Buffer`` over the default group, large enough for calls of up to ``max_tokens`` per rank."""
    return Buffer(
        None,
        low_latency_mode=True,
        backend=args.backend,
        num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(max_tokens, args.hidden, world, args.experts),
    )


def _micro_batches(x: torch.Tensor, parts: int) -> list[dict]:
    """The states of ``x`` split into ``parts`` micro-batches (views): what ``MicroBatchOverlap.run`` takes."""
    return [{"x": part} for part in torch.tensor_split(x, parts)]


def _output(states: list[dict]) -> torch.Tensor:
    return torch.cat([s["x"] for s in states])


def _capture(scheduler: MicroBatchOverlap, parts: int, static_x: torch.Tensor):
    """``(graph, output)``: one decode step of ``scheduler`` on ``static_x`` captured in a CUDA graph (after one eager
    warm-up step, which every rank runs in the same order: the low-latency calls are collective)."""
    scheduler.run(_micro_batches(static_x, parts))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        states = _micro_batches(static_x, parts)
        scheduler.run(states)
        out = _output(states)
    return graph, out


def rank_main(rank: int, world: int, args, buffer: Buffer | None = None) -> dict:
    """Time ``args.steps`` decode steps both ways (after ``args.warmup``) on ``buffer`` (default: a new one sized
    for ``args.tokens``); returns the median step time per mode and the largest output difference."""
    pg_backend = dist.get_backend()
    device = select_device(rank, args)
    if buffer is None:
        buffer = make_buffer(args, world, args.tokens)
    layers = make_params(args, rank, world, device)
    stages = build_stages(layers, buffer, args)
    plain = MicroBatchOverlap(stages, num_micro_batches=1)
    overlapped = MicroBatchOverlap(stages, num_micro_batches=args.micro_batches, stagger=args.stagger)
    modes = (("plain", plain, 1), ("overlap", overlapped, args.micro_batches))
    graphs = {}
    if getattr(args, "graph", False):  # time replays: GPU work without Python and launch cost
        if not {"low_latency_dispatch", "low_latency_combine"} <= set(buffer.engine_calls):
            raise RuntimeError(
                f"--graph: the low-latency calls have no CUDA kernels here (engine_calls={buffer.engine_calls}); the "
                "reference path syncs with the host and cannot be captured"
            )
        for mode, scheduler, parts in modes:
            static_x = torch.zeros((args.tokens, args.hidden), device=device, dtype=torch.bfloat16)
            graphs[mode] = (static_x, *_capture(scheduler, parts, static_x))

    times: dict[str, list[float]] = {"plain": [], "overlap": []}
    max_diff = 0.0
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(args.seed * 7919 + step * 131 + rank)
        x = torch.randn((args.tokens, args.hidden), generator=g).to(device=device, dtype=torch.bfloat16)
        outputs: dict[str, torch.Tensor | None] = {}
        for mode, scheduler, parts in modes:
            if graphs:
                static_x, graph, static_out = graphs[mode]
                static_x.copy_(x)
            else:
                states = _micro_batches(x, parts)
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            if graphs:
                graph.replay()
            else:
                scheduler.run(states)
            _sync(device)
            if step >= args.warmup:
                times[mode].append(time.perf_counter() - t0)
            outputs[mode] = static_out.clone() if graphs else _output(states)
        diff = (outputs["plain"].float() - outputs["overlap"].float()).abs().max().item()
        if not torch.equal(outputs["plain"], outputs["overlap"]) and not diff > 0:
            diff = float("inf")  # unequal yet no positive difference: a NaN somewhere
        max_diff = max(max_diff, diff)
    median = {mode: sorted(t)[len(t) // 2] for mode, t in times.items()}
    return {
        "rank": rank,
        "pg": pg_backend,
        "device": str(device),
        "backend": buffer.backend,
        "max_diff": max_diff,
        "step_s": median,
        "timing": "graph" if graphs else "eager",
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens per rank (= max_tokens of the LL calls)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=128, help="expert MLP width")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--stagger", type=int, default=0)
    parser.add_argument("--no-fp8", dest="fp8", action="store_false", help="BF16 dispatch instead of FP8")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--graph", action="store_true", help="capture each path's step in a CUDA graph and time replays (needs CUDA)"
    )
    parser.add_argument("--backend", default="auto", choices=("auto", "reference", "cuda"))
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument(
        "--pg-backend",
        default="auto",
        choices=("auto", "gloo", "nccl"),
        help="process group; auto = nccl with one GPU per rank, else gloo (CPU, or ranks sharing one GPU)",
    )
    return parser


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """Reject shapes the layer stack cannot run (``parser.error`` exits with the message)."""
    if args.experts % args.ranks != 0:
        parser.error(f"--experts ({args.experts}) must be a multiple of --ranks ({args.ranks})")
    if args.hidden % FP8_GROUP != 0:
        parser.error(f"--hidden ({args.hidden}) must be a multiple of {FP8_GROUP} (low-latency kernels)")
    if not 1 <= args.topk <= args.experts:
        parser.error(f"--topk ({args.topk}) must be in [1, --experts]")
    if args.tokens < args.micro_batches:
        parser.error(f"--tokens ({args.tokens}) must be at least --micro-batches ({args.micro_batches})")
    if args.graph and (args.device == "cpu" or not torch.cuda.is_available()):
        parser.error("--graph needs a CUDA device (--device cuda or auto with a GPU): it captures CUDA graphs")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    if args.pg_backend == "nccl" and (args.device == "cpu" or torch.cuda.device_count() < args.ranks):
        parser.error(f"--pg-backend nccl needs one GPU per rank ({args.ranks}), {torch.cuda.device_count()} visible")


def process_group_backend(args) -> str:
    """NCCL with one GPU per rank; gloo otherwise (CPU, or several ranks sharing a GPU: NCCL refuses that).
    On a gloo group the Buffer stages CUDA tensors through host memory where it has no kernel."""
    if args.pg_backend != "auto":
        return args.pg_backend
    use_cuda = torch.cuda.is_available() and args.device != "cpu"
    return "nccl" if use_cuda and torch.cuda.device_count() >= args.ranks else "gloo"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    results = spawn(rank_main, args.ranks, args, backend=process_group_backend(args))

    r0 = results[0]
    total_tokens = args.ranks * args.tokens
    print(
        f"dbo_decode: {args.ranks} ranks ({r0['pg']}, backend={r0['backend']}, {r0['device']}), {args.layers} layers, "
        f"hidden {args.hidden}, {args.experts} experts top-{args.topk}, {args.tokens} tokens/rank, "
        f"{'FP8' if args.fp8 else 'BF16'} dispatch; steps timed {'as CUDA-graph replays' if args.graph else 'eagerly'}"
    )
    for mode, label in (
        ("plain", "plain (1 micro-batch)"),
        ("overlap", f"overlap ({args.micro_batches} micro-batches)"),
    ):
        step_s = max(r["step_s"][mode] for r in results)  # a step ends when the slowest rank ends
        print(
            f"  {label:28s} {step_s * 1e3:8.2f} ms/step  {total_tokens / step_s:10.0f} tokens/s "
            f"(median of {args.steps})"
        )
    worst = max(r["max_diff"] for r in results)
    ok = worst == 0.0
    print(f"max |overlap - plain| over all tokens: {worst:.3e} (must be exactly 0) -> {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
