"""Loaded before the test modules, which import Ray themselves: `tokenflow.replicas` first, so
Ray starts in the local-only mode the package sets (Ray reads it when it is first imported)."""

import tokenflow.replicas  # noqa: F401
