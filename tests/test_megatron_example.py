"""examples/megatron_pretrain_moe.py runs end to end on CPU (2 gloo ranks) and "deepep" matches "allgather"."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

try:
    import megatron.core  # noqa: F401

    MEGATRON_SKIP_REASON = None
except Exception as e:  # noqa: BLE001  (ImportError, or a broken dependency such as triton raising anything)
    MEGATRON_SKIP_REASON = f"megatron-core is not importable: {type(e).__name__}: {e}"

EXAMPLE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "megatron_pretrain_moe.py"
)


# A tiny model, 3 steps on 2 gloo ranks: a few seconds on CPU.
SMALL_RUN = "--ranks 2 --steps 3 --layers 1 --hidden 32 --experts 4 --seq 16 --vocab 64 --backend gloo".split()


def _run_example(*extra: str) -> tuple[str, list]:
    """Run the example on CPU; its stdout and its loss table's rows (step, first loss, second loss, difference)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, EXAMPLE, *SMALL_RUN, *extra]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = re.findall(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)$", done.stdout, flags=re.MULTILINE)
    assert [int(r[0]) for r in rows] == [0, 1, 2], done.stdout
    return done.stdout, rows


@pytest.mark.skipif(MEGATRON_SKIP_REASON is not None, reason=MEGATRON_SKIP_REASON or "")
def test_example_trains_and_matches_allgather():
    stdout, rows = _run_example()
    for _, deepep, allgather, _ in rows:
        assert abs(float(deepep) - float(allgather)) <= 1e-5  # fp32; the example's own tolerance
    assert "OK" in stdout


@pytest.mark.skipif(MEGATRON_SKIP_REASON is not None, reason=MEGATRON_SKIP_REASON or "")
def test_example_flex_switch_matches_the_plugin():
    """Issue 20: Megatron's own flex dispatcher on ep_dispatcher through install_as_deep_ep() alone trains like our
    plugin's path (same losses, fp32)."""
    stdout, rows = _run_example("--flex-switch")
    assert "flex(switch)" in stdout, stdout
    for _, ours, flex, _ in rows:
        assert abs(float(ours) - float(flex)) <= 1e-5
