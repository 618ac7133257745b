"""``MicroBatchOverlap`` on a GPU: no host sync, and the schedule captured in a CUDA graph replays bit-exactly.

The reference backend's low-latency calls are not capturable (they read counts on the host and go through
torch.distributed), so the capture tests use a stand-in low-latency op with the same shape of API: ``send`` queues
the transfer on a side stream and returns a hook that joins it. Once the CUDA engine runs the low-latency calls
(``"low_latency_dispatch" in Buffer.engine_calls``) the last test captures the real example stack.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from ep_dispatcher import Buffer
from ep_dispatcher.dbo import YIELD, MicroBatchOverlap, Recv, Send
from ep_dispatcher.launch import free_port
from tests.gpu.common import require_gpu

pytestmark = pytest.mark.gpu
require_gpu()

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HIDDEN, MAX_TOKENS = 256, 64


class SideStreamExchange:
    """Stand-in for a low-latency call with ``return_recv_hook=True``: the send phase runs on a side stream
    (``out = 2 * x + 1``), the hook makes the current stream wait for it. Capturable."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()

    def send(self, x: torch.Tensor):
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = x * 2 + 1
        out.record_stream(torch.cuda.current_stream())

        def hook() -> None:
            torch.cuda.current_stream().wait_stream(self.stream)

        return out, hook


def _stages(weight: torch.Tensor, exchange: SideStreamExchange) -> list:
    def dense(state):
        x = state["x"]
        padded = x.new_zeros((MAX_TOKENS, HIDDEN))  # fixed GEMM shape: the split changes no row's math
        padded[: x.size(0)] = x
        state["h"] = torch.tanh(padded @ weight)[: x.size(0)]

    def send(key):
        def fn(state):
            state["recv"], hook = exchange.send(state[key])
            return hook

        return fn

    def expert(state):
        state["y"] = torch.relu(state.pop("recv")) * 0.5

    def residual(state):
        state["x"] = state["x"] + state.pop("recv")

    layer = [
        dense,
        Send("dispatch", send("h")),
        YIELD,
        Recv("dispatch"),
        expert,
        Send("combine", send("y")),
        YIELD,
        Recv("combine"),
        residual,
    ]
    return layer + layer


def _run(scheduler: MicroBatchOverlap, x: torch.Tensor) -> torch.Tensor:
    states = [{"x": part} for part in torch.tensor_split(x, scheduler.num_micro_batches)]
    scheduler.run(states)
    return torch.cat([s["x"] for s in states])


@pytest.fixture
def setup():
    torch.manual_seed(3)
    weight = torch.randn((HIDDEN, HIDDEN), device="cuda") * HIDDEN**-0.5
    stages = _stages(weight, SideStreamExchange())
    return MicroBatchOverlap(stages, 1), MicroBatchOverlap(stages, 2)


def test_eager_schedule_does_not_sync_and_matches_plain(setup):
    plain, overlapped = setup
    x = torch.randn((MAX_TOKENS, HIDDEN), device="cuda")
    expected = _run(plain, x)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside the scheduled step raises
    try:
        got = _run(overlapped, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, expected)  # bit-exact: same math per row


def test_cuda_graph_capture_replays_bit_exactly(setup):
    plain, overlapped = setup
    static_x = torch.randn((MAX_TOKENS, HIDDEN), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture stream, as torch.cuda.graph wants
        _run(overlapped, static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _run(overlapped, static_x)
    for seed in (5, 6):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = torch.randn((MAX_TOKENS, HIDDEN), device="cuda", generator=g)
        static_out.fill_(float("nan"))  # poison: the replay must write every element
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, _run(plain, x))


@pytest.mark.parametrize("timing", ["eager", "graph"])
def test_example_runs_on_gpu(timing):
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "examples", "dbo_decode.py"),
            "--ranks",
            "2",
            "--tokens",
            "16",
            "--steps",
            "2",
            "--device",
            "cuda",
        ]
        + (["--graph"] if timing == "graph" else []),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cuda" in proc.stdout and "-> OK" in proc.stdout
    assert ("CUDA-graph replays" in proc.stdout) == (timing == "graph"), proc.stdout


def _load_example():
    spec = importlib.util.spec_from_file_location("dbo_decode", os.path.join(REPO, "examples", "dbo_decode.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_buffer_low_latency_stack_under_capture():
    """The example's stages over a real ``Buffer`` inside ``torch.cuda.graph``: needs the CUDA low-latency kernels."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        example = _load_example()
        args = argparse.Namespace(tokens=16, hidden=256, ffn=128, experts=16, topk=4, layers=2, seed=1, fp8=True)
        buffer = Buffer(
            None,
            low_latency_mode=True,
            backend="auto",
            num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(args.tokens, args.hidden, 1, args.experts),
        )
        if not {"low_latency_dispatch", "low_latency_combine"} <= set(buffer.engine_calls):
            pytest.skip(
                f"the low-latency calls are not CUDA kernels yet (engine_calls={buffer.engine_calls}); the "
                "reference implementation syncs with the host and cannot be captured"
            )
        stages = example.build_stages(example.make_params(args, 0, 1, torch.device("cuda")), buffer, args)
        plain, overlapped = MicroBatchOverlap(stages, 1), MicroBatchOverlap(stages, 2)
        static_x = torch.randn((args.tokens, args.hidden), device="cuda").to(torch.bfloat16)
        _run(overlapped, static_x)  # warm-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = _run(overlapped, static_x)
        x = torch.randn_like(static_x, dtype=torch.float32).to(torch.bfloat16)
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, _run(plain, x))
    finally:
        if created:
            dist.destroy_process_group()
