"""`tokenflow serve`: the OpenAI-compatible streaming server on the real engine."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Server options plus every engine option."""
    from tokenflow.engine.engine_args import EngineArgs

    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--api-key", default=None, help="require this bearer token on /v1")
    server.add_argument("--log-level", default="info")
    EngineArgs.add_arguments(parser)


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, start the engine thread, serve until interrupted."""
    import uvicorn

    from tokenflow.engine.async_engine import AsyncEngine
    from tokenflow.engine.engine_args import EngineArgs
    from tokenflow.engine.model_config import ModelLoadError
    from tokenflow.serving.app import build_app

    if args.num_threads is None:
        # Leave one core to the HTTP thread (as vLLM does on CPU): measured faster at every
        # stream count on a 2-core machine (benchmarks/vs_vllm.py).
        args.num_threads = max(1, (os.cpu_count() or 2) - 1)
    try:
        engine = AsyncEngine(EngineArgs.from_namespace(args), start_thread=False)
    except (ModelLoadError, ValueError, OSError) as err:
        print(f"tokenflow serve: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    stats = engine.engine.scheduler.kv.config
    print(
        f"tokenflow serve: {engine.model_name} on {engine.engine.device}, policy "
        f"{args.policy}, device KV {stats.num_device_blocks * stats.block_size} tokens, host KV "
        f"{stats.num_host_blocks * stats.block_size} tokens, http://{args.host}:{args.port}",
        file=sys.stderr,
    )
    config = uvicorn.Config(
        build_app(engine, api_key=args.api_key),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
    )
    server = uvicorn.Server(config)
    http = threading.Thread(target=server.run, name="http", daemon=True)
    http.start()
    # SIGTERM (from a supervisor or `bench --compare`) stops like Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: engine.stop())
    watcher = threading.Thread(target=_stop_when_done, args=(http, engine), daemon=True)
    watcher.start()
    try:
        engine.run_loop()  # the main thread: see AsyncEngine's docstring
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        http.join(timeout=10)
        engine.close()
    return 0


def _stop_when_done(http: threading.Thread, engine: object) -> None:
    """If the HTTP server exits on its own (e.g. the port is taken), stop the engine too."""
    http.join()
    engine.stop()  # type: ignore[attr-defined]
