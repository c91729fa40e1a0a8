"""A standby's hand-off when its READY crosses the assignment: the agent sends the rank and closes its end with
READY unread, which makes the standby's first read fail (ECONNRESET) although the assignment is queued. It must
still become the rank: taken for "the agent went away" it exited 0, recorded as a finished rank, and the job
waited for it forever (bench/vs_peers.py)."""

import os
import socket
import sys

from flightdeck.events.nodelocal import ASSIGNMENT_DECODER, ASSIGNMENT_ENCODER, READY, Assignment, acts_early
from flightdeck.trainer.standby import receive, warm_target


def test_an_assignment_sent_over_an_unread_ready_is_still_received() -> None:
    agent, standby = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    standby.sendall(READY)  # ready just as the agent hands it a rank; the agent never reads it
    log = os.open(os.devnull, os.O_WRONLY)
    sent = Assignment(argv=["python", "train.py"], env={"RANK": "1"}, cwd="/")
    socket.send_fds(agent, [ASSIGNMENT_ENCODER.encode(sent)], [log])
    os.close(log)
    agent.close()
    try:
        message, fds, flags = receive(standby)
        assert ASSIGNMENT_DECODER.decode(message) == sent and len(fds) == 1 and flags == 0
        os.close(fds[0])
    finally:
        standby.close()


def test_a_retired_standby_reads_end_of_file() -> None:
    agent, standby = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    agent.close()
    try:
        assert receive(standby) == (b"", [], 0)
    finally:
        standby.close()


def test_a_job_s_own_variables_keep_the_warm_start_and_only_those_acting_before_the_assignment_make_it_cold() -> None:
    """Any `entrypoint.env` used to make every rank start cold (a Llama job's crash restart: 17.8 s against 3-4 s):
    a variable the script reads (HF_HUB_OFFLINE, its own) is set before it runs; only one that may have acted at
    the interpreter's start or in the standby's imports (torch, its thread pools, CUDA, the loader) needs an exec."""
    base = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "FLIGHTDECK_JOB_ID": "a"}
    script = [sys.executable, "train.py", "--lr", "3e-4"]

    def target(**env: str) -> tuple[str, str] | None:
        return warm_target(Assignment(argv=script, env={**base, **env}, cwd="/"), base)

    assert target() == ("path", "train.py")
    for late in ({"HF_HUB_OFFLINE": "1"}, {"WANDB_MODE": "offline", "MY_SETTING": "x"}, {"RANK": "3"},
                 {"FLIGHTDECK_JOB_ID": "b"}, {"NCCL_DEBUG": "INFO"}, {"PATH": "/opt/bin:/usr/bin"}):
        assert target(**late) == ("path", "train.py"), late
    for early in ("PYTHONHASHSEED", "PYTHONPATH", "LD_PRELOAD", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                  "CUDA_VISIBLE_DEVICES", "TORCH_LOGS", "TORCHINDUCTOR_CACHE_DIR", "PYTORCH_CUDA_ALLOC_CONF",
                  "LC_ALL", "LANG", "TMPDIR"):
        assert acts_early(early) and target(**{early: "7"}) is None, early
    removed = {k: v for k, v in base.items() if k != "OMP_NUM_THREADS"}  # unset counts as changed, too
    assert warm_target(Assignment(argv=script, env=removed, cwd="/"), base) is None
    assert not acts_early("TORCHELASTIC_RESTART_COUNT")  # read late, though it starts like torch's own
