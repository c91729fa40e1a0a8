"""The resource manager: node inventory, cordons, the allocation ledger and placement (pure core in core.py)."""
