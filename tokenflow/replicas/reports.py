"""Load reports and route facts as the plain dicts Ray Serve carries between processes
(`record_routing_stats` must return a dict; handle arguments are pickled)."""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields, replace

from tokenflow.core.consumption import Resolved, reader_rate_of
from tokenflow.core.load_report import CapacityPoint, LoadReport, RouteRequest, route_request
from tokenflow.core.prefix_summary import PrefixSummary
from tokenflow.serving.auth import bearer_token
from tokenflow.serving.classes import ClassRules, Stated
from tokenflow.serving.protocol import MAX_CHOICES, MAX_PROMPT_CACHE_KEY_CHARS
from tokenflow.serving.validation import ApiError

REPORT_KEY = "tokenflow_load_report"
AVOID_KEY = "avoid"  # in routing facts: replicas that refused the request already
PREFER_KEY = "prefer"  # in routing facts: the replica a move was planned to (board.py)
DEFAULT_MAX_TOKENS = 256  # a body without max_tokens: what the router assumes it asks
# Sizes past any context window: a body's numbers are clamped here before the router adds them.
MAX_ROUTED_TOKENS = 1 << 24
_CHARS_PER_TOKEN = 4  # the ingress has no tokenizer: prompts are sized by characters
_ROUTE_FIELDS = tuple(f.name for f in fields(RouteRequest))


def report_to_stats(report: LoadReport) -> dict[str, object]:
    """A replica's report as its routing stats."""
    return {REPORT_KEY: asdict(report)}


def report_from_stats(stats: dict[str, object] | None) -> LoadReport | None:
    """The report in a replica's routing stats; None before its first report."""
    fields = (stats or {}).get(REPORT_KEY)
    if not isinstance(fields, dict):
        return None
    points = tuple(CapacityPoint(**p) for p in fields["capacity_points"])
    prefixes = PrefixSummary(**fields.get("cached_prefixes", {}))
    return LoadReport(**{**fields, "capacity_points": points, "cached_prefixes": prefixes})


def route_facts(
    parsed: dict[str, object],
    headers: Mapping[str, str],
    rules: ClassRules,
    default_rate_tps: float,
) -> dict[str, object]:
    """What the router may know of an OpenAI request body (`guards.parse_body`'s object),
    before any replica validates it: its class and rate as the replicas will find them (`rules`
    and `default_rate_tps`: their --default-class, --api-key-class and --default-rate), its
    choices (prompts x `n`, at most the server's MAX_CHOICES), each choice's prompt size in
    tokens (a token-id list its length, text estimated from characters; several prompts their
    mean), max_tokens and the session it names (`prompt_cache_key`: the router sends a
    session's turns where its last one went, which holds its prefix).  Only those few fields
    are read, each to a bounded depth, and nothing
    is built in proportion to the prompt: the work is bounded by the body's size
    (--max-body-bytes), the facts are a few numbers whatever the body holds.  (The ingress
    counts a key's work by the same facts: `keys.work_of`.)"""
    consumption, rate_tps = _reading(parsed, headers, rules, default_rate_tps)
    max_tokens = _number(parsed.get("max_completion_tokens")) or _number(parsed.get("max_tokens"))
    num_prompts, num_prompt_tokens = _prompts(parsed)
    num_choices = min(num_prompts * _count(parsed.get("n")), MAX_CHOICES)
    facts = route_request(
        uuid.uuid4().hex,
        rate_tps,
        min(-(-num_prompt_tokens // num_prompts), MAX_ROUTED_TOKENS),
        int(min(max_tokens or DEFAULT_MAX_TOKENS, MAX_ROUTED_TOKENS)),
        consumption,
        num_choices,
        _session(parsed.get("prompt_cache_key")),
    )
    return asdict(facts)


def _session(value: object) -> str | None:
    """The session a body names, as the server reads `prompt_cache_key` (a string up to its
    length limit; anything else, refused there, is routed as no session)."""
    if isinstance(value, str) and 0 < len(value) <= MAX_PROMPT_CACHE_KEY_CHARS:
        return value
    return None


def _reading(
    parsed: dict[str, object],
    headers: Mapping[str, str],
    rules: ClassRules,
    default_rate_tps: float,
) -> Resolved:
    """The class and rate the replica gives the request (`ClassRules.resolve`), from what it
    reads: the body's `stream`, `stream_class` and `stream_rate`, the X-Stream-Class and
    X-Stream-Rate headers and the API key.  A value the replica refuses (422, 400) is read as
    not stated: the request is routed all the same, and refused there."""
    stream = parsed.get("stream") is True  # (a JSON true: the server's `stream` is strict)
    body_class = _text(parsed.get("stream_class"))
    body_rate_tps = reader_rate_of(parsed.get("stream_rate"))
    stated = Stated(
        rate_tps=reader_rate_of(headers.get("x-stream-rate")),
        stream_class=_text(headers.get("x-stream-class")),
        api_key=bearer_token(headers.get("authorization")),
    )
    try:
        return rules.resolve(stream, body_class, body_rate_tps, stated, default_rate_tps)
    except ApiError:
        unstated = replace(stated, stream_class=None)
        return rules.resolve(stream, None, body_rate_tps, unstated, default_rate_tps)


def with_avoided(facts: dict[str, object], replica_ids: Sequence[str]) -> dict[str, object]:
    """The facts of a request that these replicas (by unique id) refused: the router offers it
    to another one."""
    return {**facts, AVOID_KEY: list(replica_ids)}


def avoided_replicas(facts: object) -> frozenset[str]:
    """The replicas (by unique id) a handle call's routing facts ask the router not to pick."""
    avoid = facts.get(AVOID_KEY) if isinstance(facts, dict) else None
    return frozenset(str(i) for i in avoid) if isinstance(avoid, list) else frozenset()


def with_preferred(facts: dict[str, object], replica_id: str) -> dict[str, object]:
    """The facts of a request moved to the replica `replica_id` (by unique id): the router
    picks that one while it is a candidate."""
    return {**facts, PREFER_KEY: replica_id}


def preferred_replica(facts: object) -> str | None:
    """The replica (by unique id) a handle call's routing facts ask the router to pick; None:
    the rule chooses."""
    prefer = facts.get(PREFER_KEY) if isinstance(facts, dict) else None
    return prefer if isinstance(prefer, str) else None


def facts_to_route_request(facts: object) -> RouteRequest | None:
    """The RouteRequest of a handle call's first argument, if it carries one."""
    if not isinstance(facts, dict) or "lifetime_tokens" not in facts:
        return None
    return RouteRequest(**{name: facts[name] for name in _ROUTE_FIELDS})


def _number(value: object) -> float | None:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):  # (OverflowError: an int past 1e308)
        return None
    return number if math.isfinite(number) and number > 0 else None


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _count(value: object) -> int:
    """A count a body states (`n`), as a whole number >= 1 (1 where it states none)."""
    number = _number(value)
    return max(int(number), 1) if number is not None else 1


def _prompts(parsed: dict[str, object]) -> tuple[int, int]:
    """(prompts, their tokens in all), read as the server reads `prompt`: one text, one
    token-id list, or a list of either; a chat's messages are one prompt.  Strings are
    measured, never copied or serialized again."""
    prompt = parsed.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt), sum(_one_prompt_tokens(p) for p in prompt)
    if prompt is not None:
        return 1, _one_prompt_tokens(prompt)
    messages = parsed.get("messages")
    if not isinstance(messages, list):
        return 1, 1
    return 1, sum(_message_chars(m) for m in messages) // _CHARS_PER_TOKEN + 1


def _one_prompt_tokens(prompt: object) -> int:
    """One prompt's size: a token-id list its length, text at `_CHARS_PER_TOKEN` characters a
    token (1 for anything else: the replica refuses it)."""
    if isinstance(prompt, list):
        return max(len(prompt), 1)
    return _text_tokens(prompt)


def _message_chars(message: object) -> int:
    """A chat message's characters: its `content`, a string or a list of text parts."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        parts = (p.get("text") for p in content if isinstance(p, dict))
        return sum(len(text) for text in parts if isinstance(text, str))
    return 0


def _text_tokens(text: object) -> int:
    return len(text) // _CHARS_PER_TOKEN + 1 if isinstance(text, str) else 1
