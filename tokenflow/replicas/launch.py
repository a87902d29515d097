"""Build and run the replicas' Ray Serve application (`python -m tokenflow.replicas`).

Ray runs as one local node on the loopback (Ray's local-only mode, set by the package's
`__init__`): its node address is 127.0.0.1.  Its token authentication stays on (Ray's default
for a new local cluster: the token in ~/.ray/auth_token, made on first use; RAY_AUTH_MODE=
disabled turns it off), because a few of Ray's servers listen on every interface whatever the
node address (each Serve replica's gRPC server, on [::]), and without the token anyone who
reaches one may run code in the cluster.  Only Serve's HTTP proxy, the OpenAI endpoint,
listens where --host says (127.0.0.1 by default).

SIGTERM or SIGINT drain the fleet as `tokenflow serve` drains itself: every replica answers new
requests 503 with Retry-After, the streams in flight go on for --drain-timeout-s (a replica
option, after `--`), then Serve and Ray stop; a second signal cuts the wait short.  `leave`
drains one replica while the others serve on: its streams move to them.  `scale` sets the number
of engine replicas while they serve (Serve's external scaler); a replica that joins takes
requests queued on the others (`board.MoveBoard`), and with `--migrate paused` (the default)
also streams paused there whose buffers cover the move.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import ray
from ray import serve
from ray.actor import ActorHandle
from ray.serve.config import RequestRouterConfig

from tokenflow.core.rebalance import MigrateMode
from tokenflow.core.routing import ROUTER_NAMES
from tokenflow.replicas.board import DEFAULT_MODE, MoveBoard
from tokenflow.replicas.deployments import (
    DrainSignal,
    EngineReplica,
    served_default_rate,
    server_config,
)
from tokenflow.replicas.ingress import ingress_class
from tokenflow.replicas.router import TokenFlowRequestRouter

logger = logging.getLogger(__name__)

RAY_DEFAULT = "ray-default"  # Ray Serve's own router: power of two choices on queue lengths
ROUTERS = (*ROUTER_NAMES, RAY_DEFAULT)
APP_NAME = "tokenflow"
ENGINE_DEPLOYMENT = "TokenFlowEngine"
# What may move while every replica serves on (a leaving replica's answers always may).
MIGRATE_MODES = tuple(m.value for m in MigrateMode)
# One engine thread per replica; OpenMP workers wait passively (docs/design.md).
_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}
LOOPBACK = "127.0.0.1"
# Beyond --drain-timeout-s: for a replica to stop its engine and report, before Serve kills it.
_SHUTDOWN_SLACK_S = 5.0


def build_application(
    num_replicas: int,
    router: str,
    serve_argv: list[str],
    report_period_s: float = 1.0,
    drain_signal: ActorHandle | None = None,
    board: ActorHandle | None = None,
    replica_class: type = EngineReplica,
) -> serve.Application:
    """The ingress bound to `num_replicas` engine replicas routed by `router` (one of
    `ROUTERS`); every replica runs `tokenflow serve` with `serve_argv`, and the ingress guards
    them with its server options (--api-key, --max-body-bytes) and routes each request by the
    class and rate the replicas will give it (--default-class, --api-key-class,
    --default-rate).  `drain_signal` (a `DrainSignal`) lets `drain` reach every replica;
    `board` (a `MoveBoard` actor) moves queued requests between them; `replica_class` is for
    tests."""
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; choose one of {', '.join(ROUTERS)}")
    config = server_config(serve_argv)  # (ValueError before any replica starts)
    default_rate_tps = served_default_rate(serve_argv)
    if router == RAY_DEFAULT:
        routing = RequestRouterConfig(request_routing_stats_period_s=report_period_s)
    else:
        routing = RequestRouterConfig(
            request_router_class=TokenFlowRequestRouter,
            request_router_kwargs={"rule": router},
            request_routing_stats_period_s=report_period_s,
        )
    engine = serve.deployment(
        replica_class,
        name=ENGINE_DEPLOYMENT,
        num_replicas=num_replicas,
        max_ongoing_requests=10_000,  # the engine queues and refuses (429) by itself
        request_router_config=routing,
        health_check_period_s=2.0,
        # A replica Serve stops keeps its streams in flight as long as `tokenflow serve` would.
        graceful_shutdown_timeout_s=config.drain_timeout_s + _SHUTDOWN_SLACK_S,
        graceful_shutdown_wait_loop_s=0.5,
        ray_actor_options={"num_cpus": 0, "runtime_env": {"env_vars": _ENV}},
    )
    ingress = serve.deployment(
        ingress_class(config),
        name="OpenAIIngress",
        max_ongoing_requests=10_000,
        ray_actor_options={"num_cpus": 0},
    )
    replicas = engine.bind(serve_argv, report_period_s, drain_signal, board)
    return ingress.bind(replicas, default_rate_tps, config)


# Serve's proxy must answer its readiness check within 5 s by default: on a busy 2-core machine
# its start takes longer, and Serve would kill it in a loop.
_SERVE_ENV = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
    "RAY_worker_niceness": "0",  # (Ray lowers its workers' priority: the engines would starve)
}


def start_serve(host: str, port: int, num_cpus: int | None, object_store_mib: int) -> None:
    """Start Ray (local, small, on the loopback, its token authentication left on) and Serve's
    HTTP proxy on `host`:`port`."""
    for key, value in _SERVE_ENV.items():
        os.environ.setdefault(key, value)  # (before ray.init: Ray's processes inherit them)
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        object_store_memory=object_store_mib << 20,
        runtime_env={"env_vars": _ENV},
        ignore_reinit_error=True,
    )
    if ray.util.get_node_ip_address() != LOOPBACK:
        logger.warning(
            "Ray listens beyond the loopback: it was imported before tokenflow.replicas, "
            "which puts it in its local-only mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0)"
        )
    serve.start(http_options={"host": host, "port": port})


def stop_serve() -> None:
    """Stop Serve (its applications, its proxy) and Ray, as `start_serve` started them."""
    serve.shutdown()
    ray.shutdown()


@dataclass(frozen=True)
class Fleet:
    """The actors a running application's replicas listen to."""

    drain_signal: ActorHandle  # a `DrainSignal`: `drain`, `leave`
    board: ActorHandle | None  # a `MoveBoard` (None with --migrate off)


def start(args: argparse.Namespace, serve_argv: list[str]) -> Fleet:
    """Start Ray, Serve's HTTP proxy on --host/--port, and the application; the actors that
    `drain`, `leave` and the moves of queued requests go through."""
    config = server_config(serve_argv)
    if not _is_loopback(args.host) and not config.allowed_keys:
        logger.warning(
            "serving on %s without --api-key: anyone who reaches it may use it", args.host
        )
    start_serve(args.host, args.port, args.num_cpus, args.object_store_mib)
    drain_signal = DrainSignal.remote()
    board = None
    if args.migrate != MigrateMode.OFF.value:
        mode = MigrateMode(args.migrate)
        board = ray.remote(num_cpus=0)(MoveBoard).remote(args.report_period_s, mode)
    application = build_application(
        args.replicas,
        args.router,
        serve_argv,
        args.report_period_s,
        drain_signal=drain_signal,
        board=board,
    )
    serve.run(application, name=APP_NAME, route_prefix="/", external_scaler_enabled=True)
    return Fleet(drain_signal=drain_signal, board=board)


def scale(num_replicas: int) -> None:
    """Set the number of engine replicas of the running application (Serve's external scaler,
    which `start` enables): those running go on untouched.  New ones join and, with a board,
    take requests queued on the others once they report; those Serve stops (scale-in) get no
    refusal phase and move nothing (`leave` does, one replica at a time).  Returns at once."""
    # Serve has no Python client for its scaling API (its dashboard's REST route calls the
    # controller so): the controller, by its name in Serve's namespace.
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    deployment = DeploymentID(name=ENGINE_DEPLOYMENT, app_name=APP_NAME)
    ray.get(controller.update_deployment_replicas.remote(deployment, num_replicas))


def drain(
    drain_signal: ActorHandle,
    num_replicas: int,
    timeout_s: float,
    cut_short: threading.Event | None = None,
) -> bool:
    """Drain every engine replica (`EngineReplica.drain`) and wait until each is done, for at
    most `timeout_s` (their --drain-timeout-s) and a little more, or until `cut_short` is set.
    True when every replica sent all its answers in time."""
    ray.get(drain_signal.begin.remote())
    deadline = time.monotonic() + timeout_s + _SHUTDOWN_SLACK_S
    while time.monotonic() < deadline and not (cut_short is not None and cut_short.is_set()):
        drained = ray.get(drain_signal.drained.remote())
        if len(drained) >= num_replicas:
            return all(drained.values())
        time.sleep(0.2)
    return False


@dataclass(frozen=True)
class Departure:
    """How one replica's leave went."""

    is_drained: bool  # every answer was sent or handed off within its --drain-timeout-s
    num_handed_off: int  # answers that moved to the other replicas
    elapsed_s: float  # from the request to leave until the replica reported its drain done


def leave(drain_signal: ActorHandle, replica: str, timeout_s: float) -> Departure:
    """Drain the one engine replica `replica` (its actor name, as X-TokenFlow-Replica names it)
    while the others serve on (a scale-in, one step of a rolling restart): it refuses new
    requests, its movable answers move to the others (`EngineReplica.drain`), the rest finish
    within `timeout_s` (its --drain-timeout-s), then its engine stops.  Waits until it is
    done, or `timeout_s` and a little more passed (then `is_drained` is False)."""
    started_s = time.monotonic()
    ray.get(drain_signal.leave.remote(replica))
    done = ray.get(drain_signal.wait_done.remote(replica, timeout_s + _SHUTDOWN_SLACK_S))
    elapsed_s = time.monotonic() - started_s
    if done is None:
        return Departure(False, 0, elapsed_s)
    return Departure(done.is_drained, done.num_handed_off, elapsed_s)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The replicas' options (the engine's own follow `--`, as for `tokenflow serve`)."""
    parser.add_argument("--replicas", type=int, default=2, help="engine replicas")
    parser.add_argument("--router", default="tokenflow", choices=ROUTERS)
    parser.add_argument(
        "--host",
        default=LOOPBACK,
        help="where Serve's HTTP proxy listens (Ray itself stays on the loopback)",
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--report-period-s", type=float, default=1.0, help="replicas report their load this often"
    )
    parser.add_argument(
        "--migrate",
        choices=MIGRATE_MODES,
        default=DEFAULT_MODE.value,
        help="queued: a replica over its capacity, or one holding a request it has not started "
        "for a report period, moves its queued requests to replicas with room (one that "
        "joined); paused: also streams paused there whose buffers cover the move; off: a "
        "request stays where it was routed (a leaving replica's still move); default: %(default)s",
    )
    parser.add_argument("--num-cpus", type=int, default=None, help="Ray's CPUs (default: all)")
    parser.add_argument("--object-store-mib", type=int, default=256)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m tokenflow.replicas", description=__doc__
    )
    add_arguments(parser)
    return parser


def parse_options(argv: list[str]) -> argparse.Namespace:
    """The launcher's own options (those before `--`) as `argv` gives them, and its defaults
    for the rest: what `start` takes."""
    return _parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """`python -m tokenflow.replicas [options] -- [tokenflow serve options]`."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    ours, serve_argv = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = _parser()
    args = parser.parse_args(ours)
    try:
        config = server_config(serve_argv)
        served_default_rate(serve_argv)
    except ValueError as err:
        parser.error(str(err))
    fleet = start(args, serve_argv)
    print(
        f"serving {args.replicas} TokenFlow replicas ({args.router} router) on "
        f"http://{args.host}:{args.port}",
        flush=True,
    )
    stop, cut_short = threading.Event(), threading.Event()

    def on_signal(*_: object) -> None:
        (cut_short if stop.is_set() else stop).set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    stop.wait()
    print(f"draining (at most {config.drain_timeout_s:g} s)", flush=True)
    drained = drain(fleet.drain_signal, args.replicas, config.drain_timeout_s, cut_short)
    print("drained" if drained else "stopping with requests still in flight", flush=True)
    stop_serve()
    return 0
