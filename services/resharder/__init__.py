"""The resharder: a job's 3D-parallel plan (DP x TP x PP, ZeRO stage, micro-batches, grad accumulation).

planner.py (search) · memory.py (memory per GPU) · shapes.py (model shapes) · gpus.py (known GPU types) ·
core.py (the pure Service core: ReshardPlanned when a job's slots change) · service.py (build()).
"""
