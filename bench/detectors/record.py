"""Record the fault-free curves of the detector corpus: each shipped example and the built-in trainer run with no
platform (torchrun, telemetry to $FLIGHTDECK_EVENTS_LOG) for thousands of steps, and every rank's StepCompleted
kept as loss, lr and step time.

    .venv/bin/python -m bench.detectors.record [NAME ...] [--steps 3000]   # -> bench/detectors/curves/NAME.json

These runs have no faults injected: a spike the platform finds in one is a false one. The recorded files are
committed, so the benchmark and its test subset need no training; re-record after changing an example.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CURVES = Path(__file__).resolve().parent / "curves"


@dataclass(frozen=True)
class Source:
    name: str
    script: str  # run under torchrun; "-m flightdeck.trainer" for the built-in trainer
    ranks: int
    spec: str  # TOML: the job's own spec file, its [train] table rewritten below
    train: dict[str, object]  # [train] keys set for this recording
    what: str


EXAMPLE_TRAIN: dict[str, object] = {"checkpoint_every": 50}
BUILTIN = "examples/tiny-drill.toml"
SOURCES = [
    Source("pytorch_ddp", "examples/pytorch_ddp/train.py", 2, "examples/pytorch_ddp/job.toml", EXAMPLE_TRAIN,
           "the shipped DDP example as issue 32 ran it: an MLP classifier, 32 samples per rank, SGD+momentum"),
    Source("fsdp2", "examples/fsdp2/train.py", 2, "examples/fsdp2/job.toml", EXAMPLE_TRAIN,
           "the shipped FSDP2 example: a residual MLP regressor, AdamW"),
    Source("hf_causal_lm", "examples/hf_causal_lm/train.py", 2, "examples/hf_causal_lm/job.toml", EXAMPLE_TRAIN,
           "the shipped Hugging Face example: a tiny Llama on bytes"),
    Source("builtin-b8-lr3e-3-s1", "-m flightdeck.trainer", 1, BUILTIN, {"batch_size": 8, "lr": 3e-3, "seed": 1},
           "the built-in trainer (warm-up, cosine decay), the drill's settings"),
    Source("builtin-b2-lr1e-2-s2", "-m flightdeck.trainer", 1, BUILTIN, {"batch_size": 2, "lr": 1e-2, "seed": 2},
           "the built-in trainer, tiny batches and a high LR: the noisiest"),
    Source("builtin-b16-lr1e-3-s3", "-m flightdeck.trainer", 1, BUILTIN, {"batch_size": 16, "lr": 1e-3, "seed": 3},
           "the built-in trainer, bigger batches and a low LR"),
    Source("builtin-b4-lr3e-3-s4-synthetic", "-m flightdeck.trainer", 1, BUILTIN,
           {"batch_size": 4, "lr": 3e-3, "seed": 4, "data": "synthetic"}, "the built-in trainer on synthetic tokens"),
]


def spec_text(source: Source, steps: int) -> str:
    """The source's spec with [train] rewritten and no [[faults]] or [policy]: a fault-free run."""
    out, section = [], ""
    for line in (ROOT / source.spec).read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            section = stripped
            if section in ("[train]", "[[faults]]", "[policy]"):
                continue
        if section in ("[train]", "[[faults]]", "[policy]"):
            continue
        out.append(line)
    train = {"steps": steps, **source.train}
    out += ["[train]", *(f"{k} = {json.dumps(v)}" for k, v in train.items())]
    return "\n".join(out) + "\n"


def record(source: Source, steps: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix=f"curve-{source.name}-") as tmp:
        spec, log = Path(tmp) / "job.toml", Path(tmp) / "events.jsonl"
        spec.write_text(spec_text(source, steps))
        env = {**os.environ, "FLIGHTDECK_SPEC": str(spec), "FLIGHTDECK_EVENTS_LOG": str(log),
               "FLIGHTDECK_STAGING": str(Path(tmp) / "staging"), "PYTHONPATH": str(ROOT),
               "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        target = source.script.split()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(source.ranks),
               "--standalone", *(["-m", target[1]] if target[0] == "-m" else [str(ROOT / target[0])])]
        began = time.monotonic()
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        took = time.monotonic() - began
        rows = [json.loads(line) for line in log.read_text().splitlines()]
    steps_by_rank: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        if r["type"] == "StepCompleted":
            steps_by_rank.setdefault(r["rank"], []).append(r)
    rank0 = sorted(steps_by_rank[0], key=lambda r: r["step"])
    return {
        "name": source.name, "what": source.what, "ranks": source.ranks, "steps": steps,
        "recorded": f"python -m bench.detectors.record {source.name} --steps {steps} ({took:.0f} s, 2-core CPU box)",
        "spec": spec_text(source, steps),
        "faults": [],  # fault-free: every finding on this curve is a false one
        "loss": [round(float(r["loss"]), 7) for r in rank0],
        "lr": [float(f"{float(r['lr']):.6g}") for r in rank0],
        "step_time_s": {str(rank): [round(float(r["step_time_s"]), 6) for r in sorted(rs, key=lambda r: r["step"])]
                        for rank, rs in sorted(steps_by_rank.items())},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="sources to record (default: all)")
    ap.add_argument("--steps", type=int, default=3000)
    args = ap.parse_args()
    CURVES.mkdir(exist_ok=True)
    for source in SOURCES:
        if args.names and source.name not in args.names:
            continue
        curve = record(source, args.steps)
        (CURVES / f"{source.name}.json").write_text(json.dumps(curve, separators=(",", ":")) + "\n")
        print(f"{source.name}: {len(curve['loss'])} steps, {curve['recorded']}", flush=True)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
