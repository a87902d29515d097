"""The HTTP server's own settings (the engine's are `EngineArgs`): one validated dataclass
(tokenflow/cli/server_options.py declares its flags)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokenflow.serving.auth import read_key_file
from tokenflow.serving.classes import ClassRules
from tokenflow.serving.tenants import KeyLimits
from tokenflow.serving.tool_calls import TOOL_CALL_PARSERS

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True)
class ServerConfig:
    """How the server listens, guards, keeps its streams alive and drains."""

    host: str = "127.0.0.1"
    port: int = 8000
    # The names /v1/models lists and a request's `model` may give; responses report the first
    # (vLLM's --served-model-name).  (): the engine's model name alone.
    served_model_names: tuple[str, ...] = ()
    # Bearer tokens the server accepts (with the key file's, the admin keys and the class rules'
    # keys); with none at all the server is open.  Every route but /health and /dashboard needs
    # one (`auth.unguarded_paths`).
    api_keys: tuple[str, ...] = ()
    api_key_file: str | None = None  # more keys, one a line
    admin_api_keys: tuple[str, ...] = ()  # accepted keys that see every tenant's streams
    public_metrics: bool = False  # /metrics served without a key where the server has keys
    # Each API key's work in flight (0: no bound), counted as the engine counts it: completions
    # (every choice of every prompt), and tokens (each one's prompt + max_tokens).
    max_requests_per_key: int = 0
    max_tokens_per_key: int = 0
    # When the engine is full, a request waits this long for a slot (freed slots go to the key
    # served least: serving/tenants.py), then gets 429 (0: no wait, the engine's 429 at once).
    max_queue_wait_s: float = 10.0
    log_level: str = "info"
    # No periodic stats line (vLLM's flag; serving/stats_log.py): the /metrics series stay.
    disable_log_stats: bool = False
    # A keep-alive (a blank line, `app.KEEPALIVE`) after this many seconds without a frame on
    # every accepted stream, so that one queued or paused past a proxy's idle timeout (nginx:
    # 60 s) stays open (0: none).
    keepalive_s: float = 15.0
    # A stream whose client reads nothing for this long (its socket buffers full) is ended and
    # its request aborted (0: never).
    send_timeout_s: float = 60.0
    # Larger request bodies are refused (413) before parsing.  An 8192-token context is some
    # 32 KiB of text (about 4 characters a token), 660 KiB at the very most (SmolLM2's longest
    # token is 81 characters); 1 MiB leaves room for JSON escapes and a long chat history.
    max_body_bytes: int = 1 << 20
    health_stall_s: float = 30.0  # /health is 503 when the engine loop has not ticked this long
    # On SIGTERM/SIGINT, streams in flight have this long to finish.  Kubernetes kills the pod
    # 30 s after SIGTERM by default (terminationGracePeriodSeconds): 25 s leaves the streams
    # still open then the time to get their error frames before the kill.
    drain_timeout_s: float = 25.0
    # Requests that state no class (serving/classes.py): the default, and rules by API key.
    default_class: str = "eager"
    api_key_classes: tuple[str, ...] = ()  # "KEY=CLASS[:RATE]" each
    # Readers' streams released at their rate unless a request says otherwise (pacing.py).
    stream_pacing: bool = False
    # tool_choice "auto" (vLLM's pair of flags): the answer is free and the parser reads the
    # model's own tool-call format out of it (`tool_calls.HermesToolCalls`).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # one of TOOL_CALL_PARSERS
    class_rules: ClassRules = field(init=False, repr=False, compare=False)
    # The allow-list: api_keys, the key file's, the admin keys and the keys of class rules (a
    # class rule's key alone turns auth on); () when open.
    allowed_keys: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not (math.isfinite(self.health_stall_s) and self.health_stall_s > 0):
            raise ValueError(
                f"health_stall_s must be a finite number > 0, got {self.health_stall_s!r}"
            )
        if not (math.isfinite(self.keepalive_s) and self.keepalive_s >= 0):
            raise ValueError(f"keepalive_s must be a finite number >= 0, got {self.keepalive_s!r}")
        if not (math.isfinite(self.send_timeout_s) and self.send_timeout_s >= 0):
            raise ValueError(
                f"send_timeout_s must be a finite number >= 0, got {self.send_timeout_s!r}"
            )
        if not (math.isfinite(self.drain_timeout_s) and self.drain_timeout_s >= 0):
            raise ValueError(
                f"drain_timeout_s must be a finite number >= 0, got {self.drain_timeout_s!r}"
            )
        rules = ClassRules.parse(self.default_class, self.api_key_classes, self.stream_pacing)
        object.__setattr__(self, "class_rules", rules)
        if any(not name.strip() for name in self.served_model_names):
            raise ValueError("a served model name must not be empty")
        if any(not key.strip() for key in (*self.api_keys, *self.admin_api_keys)):
            raise ValueError("an API key must not be empty")
        from_file = read_key_file(self.api_key_file) if self.api_key_file else ()
        listed = (*self.api_keys, *from_file, *self.admin_api_keys, *sorted(rules.by_api_key))
        object.__setattr__(self, "allowed_keys", tuple(dict.fromkeys(listed)))
        if self.max_requests_per_key < 0 or self.max_tokens_per_key < 0:
            raise ValueError(
                "max_requests_per_key and max_tokens_per_key must be >= 0, got "
                f"{self.max_requests_per_key} and {self.max_tokens_per_key}"
            )
        if not (math.isfinite(self.max_queue_wait_s) and self.max_queue_wait_s >= 0):
            raise ValueError(
                f"max_queue_wait_s must be finite and >= 0, got {self.max_queue_wait_s}"
            )
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        parser = self.tool_call_parser
        if parser is not None and parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")

    def key_limits(self, capacity_choices: int = 0) -> KeyLimits:
        """Each key's bounds on work in flight, sharing `capacity_choices` engine slots
        between keys (0: none shared)."""
        return KeyLimits(
            max_choices=self.max_requests_per_key,
            max_tokens=self.max_tokens_per_key,
            capacity_choices=capacity_choices if self.max_queue_wait_s > 0 else 0,
            queue_timeout_s=self.max_queue_wait_s,
        )

    @property
    def auto_tool_call_parser(self) -> str | None:
        """The parser tool_choice "auto" uses, or None when "auto" with tools is refused."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    def auth_summary(self) -> str:
        """One line for the start-up log: whether keys are asked for, how many, and the class
        of requests that state none."""
        default = f"default class {self.default_class}"
        if not self.allowed_keys:
            return f"auth off: every request is served (no --api-key), {default}"
        num_admin = len(set(self.admin_api_keys))
        admins = f" ({num_admin} admin)" if num_admin else ""
        metrics = "/metrics public" if self.public_metrics else "/metrics needs a key"
        num_keys = len(self.allowed_keys)
        keys = f"{num_keys} API key{'s' if num_keys > 1 else ''}{admins}"
        return f"auth on: {keys}, {metrics}, {default}"
