"""`flightdeck plan` as a user runs it: a real subprocess, its stdout, stderr and exit code (no broker needed)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)
CLI = (sys.executable, "-m", "services.tools.console", "plan")
GPT3 = ("--params", "175e9", "--tokens", "10e12", "--gpus", "8192", "--gpu", "h100", "--mfu", "0.5")


def plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=30)


def test_json_holds_the_plan_its_memory_by_component_and_the_days() -> None:
    done = plan(*GPT3, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert 29 < report["days"] < 31
    assert report["dp"] * report["tp"] * report["pp"] == 8192
    assert report["micro_batches"] >= 1 and report["zero_stage"] in (0, 1, 2, 3)
    parts = report["memory_gb"]
    assert report["memory_per_gpu_gb"] == pytest.approx(
        parts["params_gb"] + parts["grads_gb"] + parts["optimizer_gb"] + parts["activations_gb"])
    assert report["memory_per_gpu_gb"] <= report["usable_gb"] < 80
    assert report["model"]["layers"] == 96 and report["model"]["derived"] == ["layers", "heads", "hidden"]


def test_given_shape_and_batch_are_used_and_the_human_report_names_each_part() -> None:
    done = plan("--params", "70e9", "--tokens", "2e12", "--gpus", "1024", "--gpu", "a100-80gb", "--layers", "80",
                "--heads", "64", "--hidden", "8192", "--seq-len", "4096", "--global-batch", "1024",
                "--gpus-per-node", "8")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["model", "gpus", "layout", "batch", "memory/GPU", "training"]
    assert "80 layers, 64 heads, hidden 8192" in lines[0] and "seq 4096" in lines[0] and "derived" not in lines[0]
    assert "1024 sequences" in lines[3] and "days" in lines[5]


def test_a_request_that_cannot_fit_exits_2_with_the_reason_on_one_line() -> None:
    done = plan("--params", "175e9", "--tokens", "10e12", "--gpus", "8", "--gpu", "h100", "--json")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("flightdeck plan: a 175B-param model needs") and "GB per GPU" in done.stderr


def test_an_unknown_gpu_lists_the_known_ones() -> None:
    done = plan("--params", "1e9", "--tokens", "1e11", "--gpus", "8", "--gpu", "v100")
    assert done.returncode == 2
    assert "unknown GPU 'v100'" in done.stderr and all(k in done.stderr for k in ("a100-40gb", "h100", "h200"))


def test_a_malformed_number_is_refused_by_the_parser() -> None:
    done = plan("--params", "lots", "--tokens", "1e11", "--gpus", "8")
    assert done.returncode == 2 and "--params" in done.stderr and "not a number" in done.stderr
