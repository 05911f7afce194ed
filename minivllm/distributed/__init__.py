"""Parallel execution: process groups (parallel_state.py), communication ops (communication.py),
the parallel layers (layers.py) and the pure arithmetic of who holds what (sharding.py)."""
