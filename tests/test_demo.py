"""The demo runs end to end and its dense check passes (and would fail on a wrong answer)."""

from __future__ import annotations

import subprocess
import sys

from ep_dispatcher import demo


def test_demo_two_ranks_in_process(capsys):
    assert demo.main(["--ranks", "2", "--steps", "1", "--tokens", "40"]) == 0
    out = capsys.readouterr().out
    assert "max |error| vs dense single-process" in out and "-> OK" in out


def test_demo_reports_failure_when_tolerance_is_impossible(capsys):
    assert demo.main(["--ranks", "2", "--steps", "1", "--tokens", "40", "--tolerance", "-1"]) == 1
    assert "-> FAIL" in capsys.readouterr().out


def test_demo_module_default_run():
    proc = subprocess.run([sys.executable, "-m", "ep_dispatcher.demo"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 ranks" in proc.stdout and "-> OK" in proc.stdout
