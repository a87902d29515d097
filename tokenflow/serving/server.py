"""The server `tokenflow serve` runs, and every engine replica of a fleet runs too: its options,
and the engine and OpenAI app built from them.

The options' module loads no torch (the command line builds its parser from it, and
`tokenflow --help` answers without torch); `build_server` imports the engine when it is called.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenflow.engine.engine_args import EngineArgs
from tokenflow.serving.config import ServerConfig

if TYPE_CHECKING:
    from fastapi import FastAPI

    from tokenflow.engine.async_engine import AsyncEngine
    from tokenflow.serving.drain import Drain
    from tokenflow.serving.moves import MoveBook


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Server options plus every engine option."""
    ServerConfig.add_arguments(parser)
    EngineArgs.add_arguments(parser)


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
    the engine cannot start."""
    from tokenflow.engine.async_engine import AsyncEngine
    from tokenflow.integrations.executors import executor_factory
    from tokenflow.serving.app import build_app
    from tokenflow.serving.drain import Drain

    build_executor = executor_factory(engine_args.executor)
    engine = AsyncEngine(engine_args, start_thread, build_executor)
    drain = Drain()
    return Server(engine=engine, drain=drain, app=build_app(engine, config, drain, moves))
