"""The server `tokenflow serve` runs, and every engine replica of a fleet runs too: the engine
and OpenAI app built from its options (tokenflow/cli/serve_options.py declares them).

This module loads no torch; `build_server` imports the engine when it is called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenflow.engine.engine_args import EngineArgs
from tokenflow.serving.config import ServerConfig

if TYPE_CHECKING:
    from fastapi import FastAPI

    from tokenflow.engine.async_engine import AsyncEngine
    from tokenflow.serving.drain import Drain
    from tokenflow.serving.moves import MoveBook


@dataclass(frozen=True)
class Server:
    """An engine, the OpenAI app over it, and the drain its owner begins to stop the app."""

    engine: AsyncEngine
    drain: Drain
    app: FastAPI


def build_server(
    engine_args: EngineArgs,
    config: ServerConfig,
    *,
    start_thread: bool,
    moves: MoveBook | None = None,
) -> Server:
    """Load the model into an engine on the executor `engine_args.executor` names, and build
    the app over it; `start_thread` as `AsyncEngine` takes it (False: the caller runs the
    engine loop), `moves` as `build_app` takes it.  ModelLoadError, ValueError or OSError when
    the engine cannot start.  Logs each phase of the start (a minute or more on a first one)."""
    from tokenflow.engine.async_engine import AsyncEngine
    from tokenflow.engine.build import timed_phase
    from tokenflow.integrations.executors import executor_factory
    from tokenflow.serving.app import build_app
    from tokenflow.serving.drain import Drain

    build_executor = executor_factory(engine_args.executor)
    starting = f"starting the engine: {engine_args.executor} executor, policy {engine_args.policy}"
    with timed_phase(starting, "started the engine"):
        engine = AsyncEngine(engine_args, start_thread, build_executor)
    drain = Drain()
    return Server(engine=engine, drain=drain, app=build_app(engine, config, drain, moves))
