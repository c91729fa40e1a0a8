"""A standby's hand-off when its READY crosses the assignment: the agent sends the rank and closes its end with
READY unread, which makes the standby's first read fail (ECONNRESET) although the assignment is queued. It must
still become the rank: taken for "the agent went away" it exited 0, recorded as a finished rank, and the job
waited for it forever (bench/vs_peers.py)."""

import os
import socket

from events.nodelocal import ASSIGNMENT_DECODER, ASSIGNMENT_ENCODER, READY, Assignment
from trainer.standby import receive


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
