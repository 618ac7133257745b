"""benchmarks/bench_dbo.py and benchmarks/bench_megatron_step.py run on CPU (2 gloo ranks, tiny shapes), write the
JSON they promise and check their results: DBO bit-exact, Megatron's two dispatchers within the example's tolerance."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

try:
    import megatron.core  # noqa: F401

    MEGATRON_SKIP_REASON = None
except Exception as e:  # noqa: BLE001  (ImportError, or a broken dependency such as triton raising anything)
    MEGATRON_SKIP_REASON = f"megatron-core is not importable: {type(e).__name__}: {e}"

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 180  # a hung rank fails the test instead of the suite


def _run_bench(script: str, out: str, *options: str) -> dict:
    command = [sys.executable, os.path.join(REPO, "benchmarks", script), "--device", "cpu", "--ranks", "2", *options]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [*command, "--out", out], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO, env=env, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    with open(out) as f:
        return json.load(f)


def test_bench_dbo_cpu(tmp_path):
    result = _run_bench(
        "bench_dbo.py",
        str(tmp_path / "dbo.json"),
        *("--tokens", "8,16", "--layers", "1", "--steps", "2", "--warmup", "1"),
        *("--hidden", "128", "--ffn", "64", "--experts", "8", "--topk", "2"),
    )
    assert result["process_group"] == "gloo" and result["devices"] == ["cpu"]
    assert set(result["per_tokens"]) == {"8", "16"}
    for row in result["per_tokens"].values():
        assert set(row) == {
            "plain_ms",
            "overlap_ms",
            "plain_tokens_per_s",
            "overlap_tokens_per_s",
            "speedup",
            "max_diff",
        }
        assert row["plain_ms"] > 0 and row["overlap_ms"] > 0
        assert row["max_diff"] == 0.0  # same math per token in both paths: bit-identical
    assert result["ok"] is True


@pytest.mark.skipif(MEGATRON_SKIP_REASON is not None, reason=MEGATRON_SKIP_REASON or "")
def test_bench_megatron_step_cpu(tmp_path):
    """Rows ours, flex_switch and allgather, each in its own processes, merged into one JSON with the per-stage
    breakdown. --host-staging always: the shim that the one-GPU run needs for the allgather baseline runs here too."""
    result = _run_bench(
        "bench_megatron_step.py",
        str(tmp_path / "megatron.json"),
        *("--steps", "2", "--warmup", "1", "--layers", "1", "--hidden", "32", "--heads", "4"),
        *("--experts", "4", "--topk", "2", "--seq", "16", "--tokens", "32", "--vocab", "64", "--moe-ffn", "48"),
        *("--host-staging", "always", "--rows", "ours,flex_switch,allgather", "--isolated-steps", "2"),
    )
    assert result["process_group"] == "gloo" and result["devices"] == ["cpu"] and result["host_staging"] is True
    assert result["rows"] == ["ours", "flex_switch", "allgather"] and result["errors"] == []
    assert set(result["dispatchers"]) == {"ours", "flex_switch", "allgather"}
    for row in result["dispatchers"].values():
        assert {"median_step_ms", "tokens_per_s", "losses", "staged_calls_per_step", "moe_ms", "stages_ms"} <= set(row)
        assert row["median_step_ms"] > 0 and len(row["losses"]) == 5  # warm-up + timed + isolated steps
        assert (
            set(row["stages_ms"]) == set(row["stages_isolated_ms"]) == {"dispatch", "permute", "unpermute", "combine"}
        )
        assert row["stages_isolated_ms"]["dispatch"]["fwd"] > 0 and row["moe_isolated_ms"] > 0
        for label, stage in row["stages_ms"].items():
            assert stage["fwd"] > 0 and stage["bwd"] >= 0, label  # every stage timed; identity stages: no backward
            if label in ("dispatch", "combine"):
                assert stage["bwd"] > 0, label
        assert 0 < row["moe_ms"] < row["median_step_ms"]
    ours, flex, allgather = (result["dispatchers"][n] for n in ("ours", "flex_switch", "allgather"))
    assert allgather["staged_calls_per_step"].get("all_gather_into_tensor", 0) > 0
    assert allgather["staged_calls_per_step"].get("reduce_scatter_tensor", 0) > 0
    assert ours["staged_calls_per_step"] == {} and flex["staged_calls_per_step"] == {}  # they stage by themselves
    assert flex["buffer"]["buffer_type"] == "ep_dispatcher.buffer.Buffer"  # the switch made Megatron use ours
    assert flex["deep_ep"].endswith(os.path.join("ep_dispatcher", "__init__.py"))
    assert ours["buffer"]["backend"] == "reference"
    assert len(flex["loss_diff_per_step"]) == 5 and set(result["ratios_vs_reference"]) == {"flex_switch", "allgather"}
    assert all("moe_isolated" in ratio for ratio in result["ratios_vs_reference"].values())
    assert result["loss_reference"] == "ours"
    assert result["tolerance"] == 1e-5  # fp32: the example's tolerance (summation order only)
    assert result["max_loss_diff"] <= result["tolerance"] and result["ok"] is True


@pytest.mark.skipif(MEGATRON_SKIP_REASON is not None, reason=MEGATRON_SKIP_REASON or "")
def test_bench_megatron_step_rejects_bad_rows(tmp_path):
    """flex_deepep (real DeepEP) needs a GPU; unknown or repeated row names are refused before anything runs."""
    script = os.path.join(REPO, "benchmarks", "bench_megatron_step.py")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    for rows, message in (
        ("ours,flex_deepep", "real DeepEP runs on GPUs only"),
        ("ours,nope", "expected distinct names"),
        ("ours,ours", "expected distinct names"),
    ):
        done = subprocess.run(
            [sys.executable, script, "--device", "cpu", "--rows", rows],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            cwd=REPO,
            env=env,
            check=False,
        )
        assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.skipif(MEGATRON_SKIP_REASON is not None, reason=MEGATRON_SKIP_REASON or "")
def test_bench_megatron_step_flex_deepep_row_needs_real_deep_ep(tmp_path):
    """The flex_deepep row refuses to run when megatron-core cannot import a real deep_ep (here: none on the path),
    naming the build command, instead of timing something else."""
    script = os.path.join(REPO, "benchmarks", "bench_megatron_step.py")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, script, "--device", "cpu", "--ranks", "2", "--steps", "1", "--warmup", "0"]
    command += ["--layers", "1", "--hidden", "32", "--heads", "4", "--experts", "4", "--seq", "16", "--tokens", "16"]
    command += ["--vocab", "64", "--row-worker", "flex_deepep", "--raw-out", str(tmp_path / "raw.json")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO, env=env, check=False)
    assert done.returncode != 0
    assert "could not import deep_ep" in done.stdout + done.stderr
    assert not (tmp_path / "raw.json").exists()


def test_profile_low_latency_phase_summary():
    """The phase trace's summary (profile_low_latency.py --phase-trace): per phase the median and the slowest block
    over the blocks that reached it; blocks that never started are left out."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        profile = pytest.importorskip("profile_low_latency")
    finally:
        sys.path.pop(0)
    stamps = torch.zeros(3, 6, dtype=torch.int64)  # ns; the third block never started
    stamps[0] = torch.tensor([1000, 3000, 4000, 10000, 11000, 0])  # not the last block: no signals
    stamps[1] = torch.tensor([2000, 3000, 9000, 12000, 14000, 20000])
    summary = profile._phase_summary(stamps)
    assert (summary["start_ns"], summary["end_ns"], summary["blocks"]) == (1000, 20000, 2)
    phases = summary["phases"]
    assert phases["plan or acks"] == (1.0, 2.0, 2)  # torch's median of an even count is the lower middle
    assert phases["peer wait"] == (1.0, 6.0, 2)
    assert phases["rows"] == (3.0, 6.0, 2)
    assert phases["arrival"] == (1.0, 2.0, 2)
    assert phases["signals"] == (6.0, 6.0, 1)
    assert profile._phase_summary(torch.zeros(2, 6, dtype=torch.int64)) == {}


def test_profile_low_latency_pair_period():
    """profile_low_latency's time per pair: the median gap between consecutive sends, so a stale kernel from before
    the profiled window or a dropped one does not double it (it did in run X1)."""
    pytest.importorskip("torch")
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        profile = pytest.importorskip("profile_low_latency")
    finally:
        sys.path.pop(0)
    steady = [1000.0 + 215.0 * i for i in range(16)]
    assert profile.pair_period_us(steady) == 215.0
    assert profile.pair_period_us([-800000.0, *steady[1:]]) == 215.0  # a stale first send
    assert profile.pair_period_us(steady[:7] + steady[8:]) == 215.0  # one send not reported
    assert profile.pair_period_us(steady[:1]) == 0.0


def test_profile_layout_needs_a_gpu():
    """benchmarks/profile_layout.py refuses to start without a GPU, with a clear message (and its --help works)."""
    script = os.path.join(REPO, "benchmarks", "profile_layout.py")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and "--impl" in done.stdout
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr
