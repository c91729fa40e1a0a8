"""A rank meets only its own job's ranks: MASTER_PORT is a rendezvous's only key, so a rank of another job on the
same host and port (another platform's, a torchrun of one's own) could join it, and once two jobs' ranks read each
other's checkpoint files. Each rank now checks its peers' job and attempt before anything is trained."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flightdeck.services.shell.broker import free_port

REPO = Path(__file__).resolve().parents[2]
RANK = """
import sys
import torch.distributed as dist
from flightdeck.trainer import distributed
code = 0
try:
    distributed.init(int(sys.argv[1]), 2, 0, "cpu", identity=sys.argv[2])
    print("joined")
    dist.destroy_process_group()  # as a run's close does: gloo may abort a process that exits with its group up
except distributed.RendezvousShared as exc:  # its group is torn down already
    print(exc)
    code = 7
sys.exit(code)
"""


def ranks(identities: tuple[str, str]) -> list[subprocess.CompletedProcess[str]]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), who], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for rank, who in enumerate(identities)]
    return [subprocess.CompletedProcess(p.args, p.wait(120), *p.communicate()) for p in procs]


@pytest.mark.timeout(180)
def test_ranks_of_two_jobs_on_one_port_refuse_each_other_and_one_job_s_ranks_join() -> None:
    mixed = ranks(("job-a attempt 0", "job-b attempt 0"))
    assert [r.returncode for r in mixed] == [7, 7], [r.stderr[-2000:] for r in mixed]
    assert mixed[0].stdout.startswith("rank 0 of job-a attempt 0 met ranks of job-b attempt 0 at 127.0.0.1:")
    assert "another job shares this rendezvous; nothing was trained" in mixed[1].stdout
    same = ranks(("job-a attempt 1", "job-a attempt 1"))
    assert [(r.returncode, r.stdout.strip()) for r in same] == [(0, "joined"), (0, "joined")], \
        [r.stderr[-2000:] for r in same]
