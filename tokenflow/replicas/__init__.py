"""TokenFlow engine replicas on Ray Serve, behind the buffer-aware routing rule.

Needs the `ray` extra (`pip install -e ".[ray]"`); nothing else in tokenflow imports it.
Launch: `python -m tokenflow.replicas --replicas 2 -- [tokenflow serve options]`
(docs/replicas.md).
"""
