"""`tokenflow serve`'s command line: the server's options, the engine's, and the model as vLLM's
`serve` takes it (`tokenflow serve MODEL`), with what they build.

Also the command line of every replica of a fleet (tokenflow/replicas/deployments.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from tokenflow.cli.engine_options import add_engine_options, engine_args_from
from tokenflow.cli.server_options import add_server_options, server_config_from
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.serving.config import ServerConfig


@dataclass(frozen=True)
class ServeOptions:
    """What a `serve` command line asks for."""

    config: ServerConfig
    engine_args: EngineArgs


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The optional positional model, the server's options, then every engine option."""
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as --model takes it (vLLM's `serve MODEL`)",
    )
    add_server_options(parser)
    add_engine_options(parser)


def serve_options_from(args: argparse.Namespace) -> ServeOptions:
    """Build from parsed options (ValueError on bad values, or a positional MODEL and a
    --model that differ)."""
    model = _model_of(args.model_tag, args.model)
    engine_args = engine_args_from(argparse.Namespace(**{**vars(args), "model": model}))
    return ServeOptions(config=server_config_from(args), engine_args=engine_args)


def _model_of(model_tag: str | None, model: str | None) -> str | None:
    if model_tag is not None and model is not None and model_tag != model:
        raise ValueError(f"the model is given twice: {model_tag} and --model {model}")
    return model_tag if model_tag is not None else model
