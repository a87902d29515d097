"""A live fleet for the tests that need one: two replicas of the embedded model on Ray Serve
behind the TokenFlow router, started by the launcher's own `start`."""

import argparse
import contextlib
from collections.abc import Iterator

import ray
from ray import serve
from ray.actor import ActorHandle

from tokenflow.eval.compare import free_port
from tokenflow.replicas.launch import start


@contextlib.contextmanager
def running_fleet(serve_argv: list[str]) -> Iterator[tuple[str, ActorHandle]]:
    """The application's URL and the signal that drains its replicas; Serve and Ray are shut
    down on exit."""
    port = free_port()
    args = argparse.Namespace(
        replicas=2,
        router="tokenflow",
        host="127.0.0.1",
        port=port,
        report_period_s=0.5,
        default_rate=4.0,
        num_cpus=2,
        object_store_mib=128,
    )
    drain_signal = start(args, serve_argv)
    try:
        yield f"http://127.0.0.1:{port}", drain_signal
    finally:
        serve.shutdown()
        ray.shutdown()
