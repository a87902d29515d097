"""Build and run the replicas' Ray Serve application (`python -m tokenflow.replicas`)."""

from __future__ import annotations

import argparse
import os
import signal
import threading

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from tokenflow.core.routing import ROUTER_NAMES
from tokenflow.replicas.deployments import EngineReplica, ingress_class
from tokenflow.replicas.router import TokenFlowRequestRouter

RAY_DEFAULT = "ray-default"  # Ray Serve's own router: power of two choices on queue lengths
ROUTERS = (*ROUTER_NAMES, RAY_DEFAULT)
APP_NAME = "tokenflow"
# One engine thread per replica; OpenMP workers wait passively (docs/design.md).
_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}


def build_application(
    num_replicas: int,
    router: str,
    serve_argv: list[str],
    report_period_s: float = 1.0,
    default_rate_tps: float = 4.0,
) -> serve.Application:
    """The ingress bound to `num_replicas` engine replicas routed by `router` (one of
    `ROUTERS`); every replica runs `tokenflow serve` with `serve_argv`."""
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; choose one of {', '.join(ROUTERS)}")
    if router == RAY_DEFAULT:
        routing = RequestRouterConfig(request_routing_stats_period_s=report_period_s)
    else:
        routing = RequestRouterConfig(
            request_router_class=TokenFlowRequestRouter,
            request_router_kwargs={"rule": router},
            request_routing_stats_period_s=report_period_s,
        )
    engine = serve.deployment(
        EngineReplica,
        name="TokenFlowEngine",
        num_replicas=num_replicas,
        max_ongoing_requests=10_000,  # the engine queues and refuses (429) by itself
        request_router_config=routing,
        health_check_period_s=2.0,
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": _ENV}},
    )
    ingress = serve.deployment(
        ingress_class(),
        name="OpenAIIngress",
        max_ongoing_requests=10_000,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(engine.bind(serve_argv, report_period_s), default_rate_tps)


# Serve's proxy must answer its readiness check within 5 s by default: on a busy 2-core machine
# its start takes longer, and Serve would kill it in a loop.
_SERVE_ENV = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
    "RAY_AUTH_MODE": "disabled",  # a local cluster on the loopback only
    "RAY_worker_niceness": "0",  # (Ray lowers its workers' priority: the engines would starve)
}


def start_serve(host: str, port: int, num_cpus: int | None, object_store_mib: int) -> None:
    """Start Ray (local, small) and Serve's HTTP proxy on `host`:`port`."""
    for key, value in _SERVE_ENV.items():
        os.environ.setdefault(key, value)  # (before ray.init: Ray's processes inherit them)
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        object_store_memory=object_store_mib << 20,
        runtime_env={"env_vars": _ENV},
        ignore_reinit_error=True,
    )
    serve.start(http_options={"host": host, "port": port})


def start(args: argparse.Namespace, serve_argv: list[str]) -> None:
    """Start Ray, Serve's HTTP proxy on --host/--port, and the application."""
    start_serve(args.host, args.port, args.num_cpus, args.object_store_mib)
    application = build_application(
        args.replicas, args.router, serve_argv, args.report_period_s, args.default_rate
    )
    serve.run(application, name=APP_NAME, route_prefix="/")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The replicas' options (the engine's own follow `--`, as for `tokenflow serve`)."""
    parser.add_argument("--replicas", type=int, default=2, help="engine replicas")
    parser.add_argument("--router", default="tokenflow", choices=ROUTERS)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--report-period-s", type=float, default=1.0, help="replicas report their load this often"
    )
    parser.add_argument("--default-rate", type=float, default=4.0, help="tok/s of a rateless body")
    parser.add_argument("--num-cpus", type=int, default=None, help="Ray's CPUs (default: all)")
    parser.add_argument("--object-store-mib", type=int, default=256)


def main(argv: list[str] | None = None) -> int:
    """`python -m tokenflow.replicas [options] -- [tokenflow serve options]`."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    ours, serve_argv = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m tokenflow.replicas", description=__doc__
    )
    add_arguments(parser)
    args = parser.parse_args(ours)
    start(args, serve_argv)
    print(
        f"serving {args.replicas} TokenFlow replicas ({args.router} router) on "
        f"http://{args.host}:{args.port}",
        flush=True,
    )
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0
