"""Simulated ranks and node agents (no torch) for measuring the control plane at thousands of ranks."""
