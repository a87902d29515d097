"""TokenFlow engine replicas on Ray Serve, behind the buffer-aware routing rule.

Needs the `ray` extra (`pip install -e ".[ray]"`); nothing else in tokenflow imports it.
Launch: `python -m tokenflow.replicas --replicas 2 -- [tokenflow serve options]`
(docs/replicas.md).

Ray runs here as one local node on the loopback: Ray's local-only mode (its default on macOS
and Windows), which Ray reads from the environment when it is imported, so it is set here,
before any module of this package imports Ray.  (`ray.init(_node_ip_address="127.0.0.1")` is
no way to it: Ray swaps a loopback address for the machine's routable one.)  Set the variable
to 1 to let Ray use the network.
"""

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
