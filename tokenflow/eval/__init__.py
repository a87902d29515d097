"""Evaluation: workloads, the bench client that plays readers and its A B B A rounds, and the
metrics and reports that score simulated and measured runs alike."""
