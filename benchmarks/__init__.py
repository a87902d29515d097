"""The benchmarks we maintain, each run from the repository root as `python -m benchmarks.NAME`."""
