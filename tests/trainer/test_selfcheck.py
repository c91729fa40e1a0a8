"""The node self-check is a real torch program: it passes on healthy CPU slots and fails with a reason."""

import json
import subprocess
import sys

import pytest


def _run(*args: str) -> tuple[int, dict[str, object]]:
    cmd = [sys.executable, "-m", "flightdeck.trainer.selfcheck", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_cpu_slots_pass_matmul_and_allreduce() -> None:
    code, out = _run("--slots", "2", "--device", "cpu")
    assert code == 0 and out["ok"] is True
    assert out["devices"] == ["cpu", "cpu"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_devices_fail_with_a_reason() -> None:
    code, out = _run("--slots", "2", "--device", "cuda")
    assert code == 1 and out["ok"] is False
    assert "CUDA" in str(out["reason"])
