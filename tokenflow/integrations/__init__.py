"""Integrations of TokenFlow's core with other serving engines (optional dependencies)."""
