"""Evaluation: workloads, the bench client that plays readers, and the metrics and reports that
score simulated and measured runs alike."""
