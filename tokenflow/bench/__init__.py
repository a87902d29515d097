"""Benchmark client: replay a workload against OpenAI-compatible servers and report metrics."""
