"""The fault explorer: the whole control plane in one process over a simulated broker and clock, driven by a seed.

Every service core runs under a shell loop that does what services/shell/runtime.py does (fold in stream order,
store the outputs with their msg ids, then ack; rebuild on a restart from `services/shell/position.py`), node
agents run their core with simulated ranks, and a seeded schedule of faults hits them: services crash between any
two steps of an input, acks are lost, the broker restarts and answers stale consumer positions, ranks crash, hang,
get SIGTERM or SIGKILL, losses spike, agents vanish, and a forged event lands on a job's subject. After each seed
the invariants (invariants.py) are checked on the recorded history. `python -m flightdeck.services.tools.explore`
runs seeds; a failing one prints the command that replays it.
"""
