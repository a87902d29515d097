"""`tokenflow serve`: the OpenAI-compatible streaming server on the real engine.

Start-up failures (the port is taken, the model does not load, bad options) print one line and
exit non-zero.  SIGTERM and SIGINT begin a graceful drain (`tokenflow.serving.drain`): /health
turns 503 at once, new requests get 503 with Retry-After, and the answers in flight go on until
they are sent or `--drain-timeout-s` has passed (a second signal cuts the wait short); then the
engine loop stops, so every stream still open ends with an error frame and `data: [DONE]`, the
HTTP server closes and the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported lazily at run time: `tokenflow --help` loads no torch
    from tokenflow.engine.async_engine import AsyncEngine
    from tokenflow.serving.config import ServerConfig
    from tokenflow.serving.drain import Drain

logger = logging.getLogger(__name__)


def configure_logging(level: str) -> None:
    """The package's loggers print like uvicorn's ("INFO:     tokenflow.x: message")."""
    from uvicorn.logging import DefaultFormatter

    handler = logging.StreamHandler()
    handler.setFormatter(
        DefaultFormatter("%(levelprefix)s %(name)s: %(message)s", use_colors=False)
    )
    root = logging.getLogger("tokenflow")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def _fail(message: str, code: int = 1) -> int:
    print(f"tokenflow serve: error: {' '.join(message.split())}", file=sys.stderr)
    return code


def _listen(host: str, port: int) -> socket.socket:
    """Bind the listening socket now, so a taken port fails at once (OSError)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, start the HTTP thread, step the engine here until a signal."""
    from tokenflow.cli.serve_options import serve_options_from

    # args.num_threads None: torch's default, every core.  With OpenMP's workers waiting
    # passively (tokenflow.cli.main sets OMP_WAIT_POLICY) the HTTP thread gets the CPU it needs: on
    # this 2-core machine, a 16-request burst (`tokenflow bench --compare fcfs --serve-args
    # "--num-threads N" --workload burst --num-requests 16 --prompt-len 128 --output-len 64`)
    # ran at 106-116 tok/s with TTFT P99 4.5 s on 2 threads against 95-96 tok/s and 5.0-5.1 s
    # on 1.  With another process busy on a core it was the other way round (1 thread 81-84
    # tok/s, 2 threads 58-66): pass --num-threads 1 on a machine shared with other work.
    try:
        options = serve_options_from(args)
    except ValueError as err:
        return _fail(str(err), 2)
    config, engine_args = options.config, options.engine_args
    configure_logging(config.log_level)
    logger.info("%s", config.auth_summary())
    try:
        sock = _listen(config.host, config.port)
    except OSError as err:
        return _fail(f"cannot listen on {config.host}:{config.port}: {err.strerror or err}")
    try:
        return _serve(sock, config, engine_args)
    finally:
        sock.close()


def _serve(sock: socket.socket, config: object, engine_args: object) -> int:
    import uvicorn

    from tokenflow.engine.engine_args import EngineArgs
    from tokenflow.model.config import ModelLoadError
    from tokenflow.serving.config import ServerConfig
    from tokenflow.serving.server import build_server

    assert isinstance(config, ServerConfig) and isinstance(engine_args, EngineArgs)
    try:
        served = build_server(engine_args, config, start_thread=False)
    except (ModelLoadError, ValueError, OSError) as err:
        return _fail(str(err), 2)
    engine, drain = served.engine, served.drain
    _log_start(engine)
    server = uvicorn.Server(
        uvicorn.Config(
            served.app,
            log_level=config.log_level,
            # Once the engine stopped, every stream ends at once: this only bounds the flush.
            timeout_graceful_shutdown=5,
        )
    )
    http = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="http", daemon=True)
    http.start()
    threading.Thread(
        target=_announce_when_listening, args=(server, http, config), name="announce", daemon=True
    ).start()
    _drain_on_signals(drain, engine, config.drain_timeout_s)
    threading.Thread(target=_stop_when_done, args=(http, engine), daemon=True).start()
    try:
        engine.run_loop()  # the main thread: see AsyncEngine's docstring
    except Exception:  # noqa: BLE001 - logged by the loop; exit non-zero below
        return _shutdown(server, http, engine, code=1)
    code = 0 if server.started else _fail("the HTTP server did not start")
    return _shutdown(server, http, engine, code)


def _shutdown(server: object, http: threading.Thread, engine: object, code: int) -> int:
    server.should_exit = True  # type: ignore[attr-defined]
    http.join(timeout=10)
    engine.close()  # type: ignore[attr-defined]
    logger.info("stopped")
    return code


def _log_start(engine: AsyncEngine) -> None:
    """What the engine serves with, once it is built (where it listens comes last)."""
    for line in engine.description.lines():
        logger.info("%s", line)


def _announce_when_listening(server: object, http: threading.Thread, config: ServerConfig) -> None:
    """Once uvicorn listens (it says so itself first), end the start-up log with the address
    and the dashboard's; nothing if the HTTP server exits before it listens."""
    while not server.started:  # type: ignore[attr-defined]
        if not http.is_alive():
            return
        threading.Event().wait(0.05)
    base = _base_url(config.host, config.port)
    logger.info("listening on %s, dashboard %s/dashboard", base, base)


def _base_url(host: str, port: int) -> str:
    """'http://HOST:PORT' (an IPv6 address in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _drain_on_signals(drain: Drain, engine: AsyncEngine, timeout_s: float) -> None:
    """SIGINT and SIGTERM begin the drain; a thread stops the engine once it is over."""
    # uvicorn runs outside the main thread, so these are the only handlers (it installs none,
    # and sse-starlette's shutdown hook, which cancels streams at once, is never called).
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: drain.begin())
    threading.Thread(
        target=_stop_after_drain, args=(drain, engine, timeout_s), name="drain", daemon=True
    ).start()


def _stop_after_drain(drain: Drain, engine: AsyncEngine, timeout_s: float) -> None:
    """Once a signal began the drain, stop the engine loop when the last answer in flight was
    sent, or after `timeout_s` (the streams still open then end with an error frame)."""
    drain.wait_begun()
    logger.info(
        "shutting down: draining %d requests in flight (at most %g s)",
        drain.num_in_flight,
        timeout_s,
    )
    if drain.wait_drained(timeout_s):
        logger.info("drained")
    else:
        logger.warning("ending %d requests still in flight with an error", drain.num_in_flight)
    engine.stop()


def _stop_when_done(http: threading.Thread, engine: object) -> None:
    """If the HTTP server exits on its own (e.g. it failed to start), stop the engine too."""
    http.join()
    engine.stop()  # type: ignore[attr-defined]
