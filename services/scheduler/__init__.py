"""The scheduler: job queue, gang admission, preemption and recovery (pure core in core.py)."""
