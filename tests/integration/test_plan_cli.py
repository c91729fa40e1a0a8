"""`flightdeck plan` as a user runs it: a real subprocess, its stdout, stderr and exit code (no broker needed)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)
CLI = (sys.executable, "-m", "flightdeck.services.tools.console", "plan")
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


# Published setups entered as their papers state them (GPUs, sustained TFLOP/s, tokens, layout), no hand conversion.
BLOOM = ("--params", "176e9", "--layers", "70", "--hidden", "14336", "--heads", "112", "--seq-len", "2048",
         "--vocab", "250880", "--tokens", "366e9", "--gpus", "384", "--gpu", "a100-80gb", "--tflops", "150",
         "--global-batch", "2048")


def test_bloom_as_published_uneven_stages_and_sustained_tflops() -> None:
    done = plan(*BLOOM, "--dp", "8", "--tp", "4", "--pp", "12", "--zero", "1", "--micro-batch-size", "2", "--json")
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    assert (r["dp"], r["tp"], r["pp"], r["zero_stage"], r["layout_given"], r["fits"]) == (8, 4, 12, 1, True, True)
    assert r["stage_layers"] == {"6": 10, "5": 2} and r["micro_batches"] == 128
    assert r["days"] == pytest.approx(6 * 176e9 * 366e9 / (384 * 150e12) / 86400)
    assert r["sustained_tflops"] == 150 and r["mfu"] == pytest.approx(150 / 312)
    human = plan(*BLOOM, "--dp", "8", "--tp", "4", "--pp", "12", "--zero", "1").stdout
    assert "(as given); stages of uneven depth: 10 x 6 + 2 x 5 layers" in human, human
    assert "366B tokens at 150 TFLOP/s per GPU (MFU 0.48): 77.7 days" in human, human


def test_opt_175b_on_992_gpus_gets_its_days_and_the_batches_that_would_split() -> None:
    done = plan("--params", "175e9", "--layers", "96", "--heads", "96", "--hidden", "12288", "--tokens", "180e9",
                "--gpus", "992", "--gpu", "a100-80gb", "--tflops", "147")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["model", "gpus", "layout", "training"]
    assert "none: no DP x TP x PP layout of 992 GPUs splits a global batch of 2048 sequences" in lines[2]
    assert "ones that split: 2046, 2077, 2108" in lines[2]
    assert lines[3].endswith("180B tokens at 147 TFLOP/s per GPU (MFU 0.47): 15.0 days"), lines[3]


def test_a_given_layout_that_does_not_fit_is_reported_and_exits_2() -> None:
    done = plan(*BLOOM, "--dp", "128", "--tp", "1", "--pp", "3", "--zero", "0")
    assert done.returncode == 2
    assert "DOES NOT FIT" in done.stdout and "the given layout needs" in done.stderr
    done = plan(*BLOOM, "--dp", "8", "--tp", "3", "--pp", "16")
    assert done.returncode == 2 and "TP 3 does not divide the model's 112 attention heads" in done.stderr
    both = plan(*BLOOM, "--mfu", "0.4")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
