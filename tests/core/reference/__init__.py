"""The slow, obvious reference of the scheduler and the FCFS / TokenFlow policies.

These are the straightforward implementations the fast paths replaced (every decision and step
rescans every request).  `tests/core/test_parity.py` drives both on randomized long runs and
requires identical decision traces, so every incremental structure in `tokenflow.core` is
checked against a recomputation from scratch.  Change a rule here and there together.
"""
