"""Flightdeck side by side with the platforms a user would try instead, on the same training script and the same
faults: seconds from the fault to the first step after recovery, steps of work lost, the steps the job still did
while it recovered, and the loop's stall per checkpoint save. Medians of interleaved runs, the load recorded.

    make bench-peers                                   # its own .venv-peers with torchft and DLRover; 5 runs
    .venv-peers/bin/python bench/vs_peers.py --runs 1 --faults crash --sides torchrun,torchft

The script is bench/peers/train.py on 2 CPU ranks (gloo): a 3-layer MLP 1024 wide (13 MB of weights, as much
momentum), paced at 0.05 s a step, a save every 10 steps; the fault at step 60: `crash` (rank 1 exits
with code 3), `hang` (rank 0 stops stepping, its process alive) or `lost_node`: each rank on a node of its own
(two launchers or agents on this box, sharing only its disk), and the rank on node 2 SIGKILLs that node's whole
process tree, its launcher or agent included; what is left may go on with one rank. Each side saves and recovers
its own way:

    flightdeck-warm  every service and one node agent on a fresh nats-server, the drills' policy (hung after 3 s
                     without progress; tests/e2e/drill_harness.py); the script uses the Flightdeck API; the
                     agent hands restarted ranks to warm standbys (its default)
    flightdeck-cold  the same with `--standby 0`: each restarted rank a fresh process
    torchrun         `torchrun --standalone --nproc-per-node 2 --max-restarts 1`; rank 0 `torch.save`s
    dlrover          `dlrover-run --standalone --nproc-per-node 2 --max-restarts 1` (DLRover 0.6.1) and its flash
                     checkpoint: shared memory every save, disk every 4th. On torch 2.13 `dlrover-run
                     --standalone` cannot start its own local master (DLROVER_LAUNCH_ERROR below), so the bench
                     starts that master itself, with the command dlrover-run would have run, and points
                     dlrover-run at it (DLROVER_MASTER_ADDR); everything else is DLRover's own path
    torchft          torchft 0.2.0: `torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000` (its README's
                     example) and each rank its own replica group under `torchrun --max-restarts 1`; Manager,
                     DistributedDataParallel and Optimizer on gloo (Manager timeout 10 s); no disk checkpoint

For `lost_node`: Flightdeck runs two single-slot agents and a job that may shrink to one slot (policy.min_slots
1); torchrun two agents of one c10d rendezvous (`--nnodes 1:2`), node 1 hosting its store, with keep-alives that
find a dead node in 2 s as Flightdeck's drill policy does (TORCHRUN_KEEP_ALIVE); DLRover two `dlrover-run --nnodes
1:2` agents (NODE_RANK 0 and 1) of one local master started for 2 nodes, its last call 1 s (DLROVER_LAST_CALL);
torchft loses a replica group's node.

Measured from the script's own event lines (one machine, one clock): `recover_s` from the fault to the first
step by a process started after it (none within --cap-s: recorded as null, with why); `progress_s` from the
fault to the first step past the fault's own step by any process (new work: a restart that redoes steps gets
there later, a survivor that trains on sooner); `lost_steps` the steps done before the fault that were done
again; `steps_meanwhile` the steps the surviving processes still committed between the fault and the first
restarted step (torchft trains on; the others stop); `stall_s` per save, the slowest rank's hold of the loop,
median over the saves before the fault. A run ends AFTER_STEPS steps past the fault, or at the cap.
"""

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import structlog

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flightdeck.events.spec import EntrypointSpec, TrainSpec  # noqa: E402
from flightdeck.services.shell import broker  # noqa: E402
from tests.e2e.drill_harness import drill_spec, start_drill, start_two_nodes  # noqa: E402

SIDES = ("flightdeck-warm", "flightdeck-cold", "torchrun", "dlrover", "torchft")
FAULTS = ("crash", "hang", "lost_node")
STEPS, FAULT_AT, EVERY, PACE_S = 1000, 60, 10, 0.05  # runs end AFTER_STEPS after recovery, not at STEPS
AFTER_STEPS = 10
SCRIPT = ROOT / "bench" / "peers" / "train.py"
# torchrun's rendezvous set to find a dead node as soon as Flightdeck's drill policy does (2 s without a beat);
# its defaults are 5 s x 3 keep-alives and a 30 s last call before a shrunk round closes
TORCHRUN_KEEP_ALIVE = "keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=1"
# DLRover's master closes a rendezvous short of its nodes after this last call (60 s by default; its agent's flag)
DLROVER_LAST_CALL = "lastcall_timeout=1"
BIN = Path(sys.executable).parent
DLROVER_LAUNCH_ERROR = ("dlrover-run --standalone on torch 2.13.0: TypeError: SubprocessHandler.__init__() missing 1 "
                        "required positional argument: 'numa_options' (dlrover/trainer/torch/elastic_run.py:326, "
                        "_launch_dlrover_local_master)")
NO_HANG_DETECTION = {  # what each run's logs showed when nothing recovered from a hang within the cap
    "torchrun": "torchrun watches only for exits: the other rank waits in gloo's all-reduce (30 min by default)",
    "dlrover": "nothing acted on the stalled rank: DLRover 0.6.1's diagnosis reads xpu_timer metrics (collected "
               "every 60 s, for GPUs), and the other rank waits in gloo's all-reduce",
    "torchft": "the hung replica's manager keeps heartbeating, and its lighthouse forms no quorum for the survivor "
               "alone: 'New quorum not ready, only have 1 participants, need at least half of 2 healthy workers' "
               "(with 2 replica groups; none in 150 s in a longer run either)",
}

NO_RESTART_ON_LOST_NODE = {
    "torchft": "nothing restarts: the lost replica group's node is gone, and the survivor trains on alone "
               "(progress_s is its first step past the fault)",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def script_args(peer: str, workdir: Path, fault: str) -> list[str]:
    return [str(SCRIPT), "--peer", peer, "--workdir", str(workdir), "--fault", fault, "--fault-step", str(FAULT_AT),
            "--steps", str(STEPS), "--every", str(EVERY), "--pace-s", str(PACE_S)]


def rows(workdir: Path) -> list[dict[str, Any]]:
    path = workdir / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        with contextlib.suppress(ValueError):  # a line being written as we read
            out.append(json.loads(line))
    return out


def finished(workdir: Path, cap_s: float, began: float, limit_s: float) -> bool:
    """Whether the run has shown what it can: AFTER_STEPS steps past the fault's step done by processes started
    after it (after a lost node, by any process: a survivor that trains on may be all there is), or the cap past
    the fault, or the whole run's limit."""
    now = time.time()
    events = rows(workdir)
    fault = next((r["t"] for r in events if r["kind"] == "fault"), None)
    if now - began > limit_s or (fault is not None and now - fault > cap_s):
        return True
    if fault is None:
        return False
    lost_node = any(r["kind"] == "fault" and r.get("fault") == "lost_node" for r in events)
    before = set() if lost_node else {r["pid"] for r in events if r["t"] <= fault}
    return sum(r["kind"] == "step" and r["pid"] not in before and r["step"] >= FAULT_AT and r["t"] > fault
               for r in events) >= AFTER_STEPS


def wait(workdir: Path, cap_s: float, alive: Callable[[], bool], limit_s: float = 300.0) -> None:
    began = time.time()
    while alive() and not finished(workdir, cap_s, began, limit_s):
        time.sleep(0.2)


def measure(workdir: Path, cap_s: float) -> dict[str, Any]:
    events = rows(workdir)
    faults = [r for r in events if r["kind"] == "fault"]
    if not faults:
        raise RuntimeError(f"the fault never fired; events: {events[-5:]}")
    t0 = faults[0]["t"]
    before = {r["pid"] for r in events if r["t"] <= t0}
    done_before = [r["step"] for r in events if r["kind"] == "step" and r["t"] <= t0]
    # torchft's restarted replica may commit a step alone before its first quorum with the survivor sends it the
    # live state (a step 0 with itself the only participant): it has rejoined the job once it steps with others
    new_steps = sorted((r for r in events if r["kind"] == "step" and r["pid"] not in before
                        and r.get("participants", 2) > 1), key=lambda r: r["t"])
    first = new_steps[0]["t"] if new_steps else None
    resumed_from = new_steps[0]["step"] if new_steps else None  # torchft's replica learns its step when it heals
    onward = [r["t"] for r in events if r["kind"] == "step" and r["t"] > t0 and r["step"] >= faults[0]["step"]]
    until = first if first is not None else t0 + cap_s
    meanwhile = {r["step"] for r in events if r["kind"] == "step" and r["pid"] in before and t0 < r["t"] <= until}
    saves: dict[int, float] = {}
    holds: dict[int, float] = {}
    for r in events:
        if r["kind"] in ("save", "hold") and r["t"] <= t0:
            into = saves if r["kind"] == "save" else holds
            into[r["step"]] = max(into.get(r["step"], 0.0), r["stall_s"])
    last = max(done_before, default=-1)
    return {
        "recover_s": None if first is None else first - t0,
        "progress_s": min(onward) - t0 if onward else None,
        "resumed_from_step": resumed_from,
        "lost_steps": None if resumed_from is None else max(0, last + 1 - resumed_from),
        "last_step_before": last,
        "steps_meanwhile": len(meanwhile),
        "stall_s": statistics.median(saves.values()) if saves else None,
        "stall_max_s": max(saves.values()) if saves else None,
        "saves": len(saves),
        # Flightdeck between saves: the slowest rank's hold per step, and the worst (a host snapshot when due)
        "hold_s": statistics.median(holds.values()) if holds else None,
        "hold_max_s": max(holds.values()) if holds else None,
    }


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def launch(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def base_env() -> dict[str, str]:
    # OMP as the node agent sets it; no job id: the Flightdeck API stays out of the peers' runs
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLIGHTDECK_")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def kill_ranks(workdir: Path) -> None:
    """Every process still running this run's script: the launchers start their workers in sessions of their
    own, so killing a launcher's group left hung and restarted ranks behind."""
    mark = str(workdir).encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError, ValueError):
                if str(SCRIPT).encode() in (cmd := (proc / "cmdline").read_bytes()) and mark in cmd:
                    os.kill(int(proc.name), signal.SIGKILL)


def lose(workdir: Path, node: subprocess.Popen[bytes]) -> None:
    """Name the process whose tree is the node a `lost_node` fault takes away (bench/peers/train.py kills it)."""
    (workdir / "lost-node.pid").write_text(str(node.pid))


def run_launchers(procs: list[subprocess.Popen[bytes]], workdir: Path, cap_s: float,
                  lost: subprocess.Popen[bytes] | None = None) -> dict[str, Any]:
    """Wait while every launcher runs (but the lost node's, which the fault kills), then measure."""
    if lost is not None:
        lose(workdir, lost)
    try:
        wait(workdir, cap_s, lambda: all(p.poll() is None for p in procs if p is not lost))
        return measure(workdir, cap_s)
    finally:
        for p in procs:
            kill_group(p)
        kill_ranks(workdir)


def torchrun_once(workdir: Path, fault: str, cap_s: float) -> dict[str, Any]:
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: without it the restarted group reads the first one's gloo addresses
    # (pytorch/pytorch#135712; bench/vs_torchrun.py)
    env = {**base_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if fault == "lost_node":
        return torchrun_two_nodes(workdir, cap_s, env)
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           *script_args("torchrun", workdir, fault)]
    return run_launchers([launch(cmd, workdir / "torchrun.log", env)], workdir, cap_s)


def torchrun_two_nodes(workdir: Path, cap_s: float, env: dict[str, str]) -> dict[str, Any]:
    """Two torchrun agents (one rank each) in one c10d rendezvous that may shrink to one node; node 1 hosts its
    store, as the host named in --rdzv-endpoint does. A node is dead after TORCHRUN_KEEP_ALIVE."""
    port = free_port()
    nodes = []
    for n in (1, 2):
        conf = f"is_host={int(n == 1)},{TORCHRUN_KEEP_ALIVE}"
        cmd = [str(BIN / "torchrun"), "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", workdir.name,
               "--rdzv-conf", conf, *script_args("torchrun", workdir, "lost_node")]
        nodes.append(launch(cmd, workdir / f"torchrun-node{n}.log", env))
    return run_launchers(nodes, workdir, cap_s, lost=nodes[1])


def dlrover_once(workdir: Path, fault: str, cap_s: float) -> dict[str, Any]:
    nodes = 2 if fault == "lost_node" else 1
    port, job = free_port(), f"peers-{workdir.name}"
    master = launch([sys.executable, "-u", "-m", "dlrover.python.master.main", "--port", str(port), "--node_num",
                     str(nodes), "--job_name", job, "--platform", "local"], workdir / "dlrover-master.log",
                    base_env())
    env = {**base_env(), "DLROVER_MASTER_ADDR": f"127.0.0.1:{port}", "JOB_NAME": job}
    if nodes == 1:
        cmd = [str(BIN / "dlrover-run"), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
               *script_args("dlrover", workdir, fault)]
        return run_launchers([master, launch(cmd, workdir / "dlrover.log", env)], workdir, cap_s)
    # two agents of one job on the master, one rank each, that may shrink to one node
    agents = []
    for n in range(2):
        cmd = [str(BIN / "dlrover-run"), "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "1",
               "--rdzv-conf", DLROVER_LAST_CALL, *script_args("dlrover", workdir, fault)]
        agents.append(launch(cmd, workdir / f"dlrover-node{n}.log", {**env, "NODE_RANK": str(n), "NODE_ID": str(n)}))
    return run_launchers([master, *agents], workdir, cap_s, lost=agents[1])


def torchft_once(workdir: Path, fault: str, cap_s: float) -> dict[str, Any]:
    port = free_port()
    lighthouse = launch([str(BIN / "torchft_lighthouse"), "--min_replicas", "1", "--quorum_tick_ms", "100",
                         "--join_timeout_ms", "10000", "--bind", f"127.0.0.1:{port}"], workdir / "lighthouse.log",
                        base_env())
    groups = []
    for g in range(2):
        env = {**base_env(), "REPLICA_GROUP_ID": str(g), "NUM_REPLICA_GROUPS": "2",
               "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}
        cmd = [str(BIN / "torchrun"), "--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", "1",
               "--master-port", str(free_port()), *script_args("torchft", workdir, fault)]
        groups.append(launch(cmd, workdir / f"group{g}.log", env))
    # a lost node is a replica group gone with its torchrun: nothing restarts it, the survivor trains on
    return run_launchers([lighthouse, *groups], workdir, cap_s, lost=groups[1] if fault == "lost_node" else None)


async def flightdeck_once(workdir: Path, fault: str, cap_s: float, standby: int,
                          snapshot_max_overhead: float) -> dict[str, Any]:
    b = broker.start(workdir / "nats")
    (workdir / "platform").mkdir()
    p = await start_drill(b.url, workdir / "platform")
    try:
        if fault == "lost_node":  # two single-slot nodes; the job may shrink to one (the lost-node drill)
            await start_two_nodes(p, "--standby", str(standby))
            lose(workdir, p.procs["agent-n2"])
        else:
            p.agent("n1", "--grace-s", "2", "--standby", str(standby))
            await p.ready("n1", within=120)
        spec = msgspec.structs.replace(
            drill_spec("peers", steps=STEPS, **({"min_slots": 1} if fault == "lost_node" else {})),
            train=TrainSpec(steps=STEPS, checkpoint_every=EVERY, snapshot_max_overhead=snapshot_max_overhead),
            entrypoint=EntrypointSpec(command=["python", *script_args("flightdeck", workdir, fault)], cwd=str(ROOT)))
        await p.submit(spec, f"peers-{uuid.uuid4().hex[:6]}")
        await asyncio.to_thread(wait, workdir, cap_s, lambda: True)
        return measure(workdir, cap_s)
    finally:
        await p.close()
        b.stop()


def once(side: str, fault: str, cap_s: float, keep: Path | None = None,
         snapshot_max_overhead: float = TrainSpec().snapshot_max_overhead) -> dict[str, Any]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    kept = contextlib.nullcontext(tempfile.mkdtemp(prefix=f"{fault}-{side}-", dir=keep)) if keep else None
    with kept or tempfile.TemporaryDirectory(prefix=f"fd-peers-{side}-") as tmp:
        workdir = Path(tmp)
        load = os.getloadavg()[0]
        began = time.monotonic()
        if side == "torchrun":
            out = torchrun_once(workdir, fault, cap_s)
        elif side == "dlrover":
            out = dlrover_once(workdir, fault, cap_s)
        elif side == "torchft":
            out = torchft_once(workdir, fault, cap_s)
        else:
            out = asyncio.run(flightdeck_once(workdir, fault, cap_s, standby=0 if side == "flightdeck-cold" else 2,
                                              snapshot_max_overhead=snapshot_max_overhead))
        if out["recover_s"] is None:
            out["why"] = {"hang": NO_HANG_DETECTION, "lost_node": NO_RESTART_ON_LOST_NODE}.get(fault, {}).get(side) \
                or f"no step by a restarted process within {cap_s:.0f} s of the fault"
        return {**out, "load_1m": load, "run_s": time.monotonic() - began}


def median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--cap-s", type=float, default=40.0, help="give up on a recovery this long after the fault")
    ap.add_argument("--out", type=Path, default=None, help="write every run and the medians here as JSON")
    ap.add_argument("--keep", type=Path, default=None, help="keep each run's folder (logs, events) under this one")
    ap.add_argument("--snapshot-max-overhead", type=float, default=TrainSpec().snapshot_max_overhead,
                    help="Flightdeck's train.snapshot_max_overhead (1: a host snapshot every step, whatever it costs)")
    args = ap.parse_args()
    sides, faults = args.sides.split(","), args.faults.split(",")
    if args.runs < 1 or not set(sides) <= set(SIDES) or not set(faults) <= set(FAULTS):
        ap.error(f"--runs >= 1, --sides from {SIDES}, --faults from {FAULTS}")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {f: {s: [] for s in sides} for f in faults}
    for n in range(1, args.runs + 1):  # interleaved: a busy spell of the box does not favour one side
        for fault in faults:
            for side in sides:
                try:
                    result = once(side, fault, args.cap_s, args.keep, args.snapshot_max_overhead)
                except Exception as exc:  # recorded as it failed, never left out
                    result = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                runs[fault][side].append(result)
                print(f"{fault} {side} run {n}: {json.dumps(result)}", flush=True)
    keys = ("recover_s", "progress_s", "lost_steps", "steps_meanwhile", "stall_s", "hold_s", "hold_max_s", "load_1m")
    medians = {f: {s: {k: median(rs, k) for k in keys} for s, rs in by.items()} for f, by in runs.items()}
    report = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "command": " ".join(["bench/vs_peers.py", *sys.argv[1:]]),
        "script": {"steps": STEPS, "fault_at": FAULT_AT, "save_every": EVERY, "pace_s": PACE_S, "ranks": 2},
        "flightdeck": {"snapshot_every": TrainSpec().snapshot_every,
                       "snapshot_max_overhead": args.snapshot_max_overhead},
        "dlrover_launch_error": DLROVER_LAUNCH_ERROR,
        "runs": runs, "median": medians,
    }
    for fault, by in medians.items():
        for side, m in by.items():
            shown = ", ".join(f"{k} {v:.3g}" if v is not None else f"{k} -" for k, v in m.items())
            print(f"{fault:<6} {side:<16} {shown}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
