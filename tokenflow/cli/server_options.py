"""The HTTP server's options (`ServerConfig`) on a command line, and the `ServerConfig` a parsed
command line builds.  Read alone by the fleet's ingress (`replicas.deployments.server_config`),
which never loads an engine."""

from __future__ import annotations

import argparse

from tokenflow.serving.classes import CLASS_NAMES
from tokenflow.serving.config import LOG_LEVELS, ServerConfig
from tokenflow.serving.tool_calls import TOOL_CALL_PARSERS


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """Options for every `ServerConfig` field."""
    server = parser.add_argument_group("server")
    defaults = ServerConfig()
    _add_listen_options(server, defaults)
    _add_auth_options(server)
    _add_key_limit_options(server, defaults)
    _add_log_options(server, defaults)
    _add_connection_options(server, defaults)
    _add_class_options(server, defaults)
    _add_tool_options(server)


def server_config_from(args: argparse.Namespace) -> ServerConfig:
    """Build from parsed options (ValueError on bad values)."""
    return ServerConfig(
        host=args.host,
        port=args.port,
        served_model_names=tuple(args.served_model_name or ()),
        api_keys=tuple(args.api_keys),
        api_key_file=args.api_key_file,
        admin_api_keys=tuple(args.admin_api_keys),
        public_metrics=args.public_metrics,
        max_requests_per_key=args.max_requests_per_key,
        max_tokens_per_key=args.max_tokens_per_key,
        max_queue_wait_s=args.max_queue_wait_s,
        log_level=args.log_level,
        disable_log_stats=args.disable_log_stats,
        keepalive_s=args.keepalive_s,
        send_timeout_s=args.send_timeout_s,
        max_body_bytes=args.max_body_bytes,
        health_stall_s=args.health_stall_s,
        drain_timeout_s=args.drain_timeout_s,
        default_class=args.default_class,
        api_key_classes=tuple(args.api_key_classes),
        stream_pacing=args.stream_pacing,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
    )


def _add_listen_options(server: argparse._ArgumentGroup, defaults: ServerConfig) -> None:
    """Where the server listens, and the names it serves the model under."""
    server.add_argument("--host", default=defaults.host)
    server.add_argument("--port", type=int, default=defaults.port)
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names /v1/models lists and a request's model may give; responses report "
        "the first (default: the model's path, or SmolLM2-135M-Instruct) (vLLM's flag)",
    )


def _add_auth_options(server: argparse._ArgumentGroup) -> None:
    """The keys the server accepts, and who sees what."""
    server.add_argument(
        "--api-key",
        action="extend",
        nargs="+",
        default=[],
        dest="api_keys",
        metavar="KEY",
        help="accept this bearer token (repeatable, or several after one flag as vLLM takes "
        "them); with keys every route but /health and /dashboard needs one, with none (nor a "
        "key file, admin or class key) the server is open",
    )
    server.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="accept the bearer tokens in FILE too, one a line (# comments)",
    )
    server.add_argument(
        "--admin-api-key",
        action="append",
        default=[],
        dest="admin_api_keys",
        metavar="KEY",
        help="accept this bearer token, and show it every tenant's streams on "
        "/v1/tokenflow/streams (other keys see their own); repeatable",
    )
    server.add_argument(
        "--public-metrics",
        action="store_true",
        help="serve /metrics without a key where the server has keys",
    )


def _add_key_limit_options(server: argparse._ArgumentGroup, defaults: ServerConfig) -> None:
    """Each API key's share of the engine."""
    server.add_argument(
        "--max-requests-per-key",
        type=int,
        default=defaults.max_requests_per_key,
        help="completions in flight one API key may have (each choice of each prompt "
        "counts: n=4 is 4); more get 429 naming the limit (0: no bound)",
    )
    server.add_argument(
        "--max-tokens-per-key",
        type=int,
        default=defaults.max_tokens_per_key,
        help="tokens in flight one API key may have (each completion's prompt + "
        "max_tokens); more get 429 naming the limit (0: no bound)",
    )
    server.add_argument(
        "--max-queue-wait-s",
        type=float,
        default=defaults.max_queue_wait_s,
        help="when the engine is full, a request waits this long for a slot (freed slots "
        "go to the API key served least), then gets 429 (0: 429 at once)",
    )


def _add_log_options(server: argparse._ArgumentGroup, defaults: ServerConfig) -> None:
    server.add_argument("--log-level", default=defaults.log_level, choices=LOG_LEVELS)
    server.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic stats line (vLLM's: throughput, running, waiting and paused "
        "requests, KV cache usage every 10 s while there is traffic)",
    )


def _add_connection_options(server: argparse._ArgumentGroup, defaults: ServerConfig) -> None:
    """How streams are kept alive and ended, how large a body may be, and the drain."""
    server.add_argument(
        "--keepalive-s",
        type=float,
        default=defaults.keepalive_s,
        help="a keep-alive (a blank line, which every SSE client skips) after this many "
        "seconds of silence on a stream, for proxies' idle timeouts (0: none)",
    )
    server.add_argument(
        "--send-timeout-s",
        type=float,
        default=defaults.send_timeout_s,
        help="end a stream (and abort its request) whose client reads nothing for this "
        "long (0: never)",
    )
    server.add_argument(
        "--max-body-bytes",
        type=int,
        default=defaults.max_body_bytes,
        help="refuse larger request bodies (413)",
    )
    server.add_argument(
        "--health-stall-s",
        type=float,
        default=defaults.health_stall_s,
        help="/health answers 503 when the engine loop has not ticked for this long",
    )
    server.add_argument(
        "--drain-timeout-s",
        type=float,
        default=defaults.drain_timeout_s,
        help="on SIGTERM/SIGINT, let streams in flight finish for this long, then end them "
        "with an error frame (0: at once)",
    )


def _add_class_options(server: argparse._ArgumentGroup, defaults: ServerConfig) -> None:
    """The stream classes of requests that state none, and pacing."""
    server.add_argument(
        "--default-class",
        default=defaults.default_class,
        choices=CLASS_NAMES,
        help="class of a streamed request that states none: eager (reads each token at "
        "once: agents, benchmark clients, the default), reader (at --default-rate)",
    )
    server.add_argument(
        "--api-key-class",
        action="append",
        default=[],
        dest="api_key_classes",
        metavar="KEY=CLASS[:RATE]",
        help="class (and a reader's rate) of requests with this bearer token, e.g. "
        "chat-key=reader:6 or agents-key=eager; binding (a request's stream_class and "
        "stream_rate cannot change it) unless written KEY=~CLASS[:RATE]; the key is "
        "accepted (and turns auth on); repeatable",
    )
    server.add_argument(
        "--stream-pacing",
        action="store_true",
        help="send a reader's tokens at its reading rate from its first token, not as the "
        "engine makes them (smooth text in a UI that shows it as it comes; not for clients "
        "that pace themselves); a request's stream_pacing or X-Stream-Pacing decides first",
    )


def _add_tool_options(server: argparse._ArgumentGroup) -> None:
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='answer tool_choice "auto" with tools (the default when tools are given): the '
        "model writes its calls in its own format, --tool-call-parser reads them",
    )
    server.add_argument(
        "--tool-call-parser",
        default=None,
        choices=TOOL_CALL_PARSERS,
        help="the model's tool-call format: hermes (<tool_call>{...}</tool_call>, as "
        "Hermes and Qwen2.5 write them)",
    )
