"""Load reports and route facts as the plain dicts Ray Serve carries between processes
(`record_routing_stats` must return a dict; handle arguments are pickled)."""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import asdict

from tokenflow.core.request import Consumption
from tokenflow.core.routing import CapacityPoint, LoadReport, RouteRequest, route_request

REPORT_KEY = "tokenflow_load_report"
DEFAULT_MAX_TOKENS = 256  # a body without max_tokens: what the router assumes it asks
_CHARS_PER_TOKEN = 4  # the ingress has no tokenizer: prompts are sized by characters


def report_to_stats(report: LoadReport) -> dict[str, object]:
    """A replica's report as its routing stats."""
    return {REPORT_KEY: asdict(report)}


def report_from_stats(stats: dict[str, object] | None) -> LoadReport | None:
    """The report in a replica's routing stats; None before its first report."""
    fields = (stats or {}).get(REPORT_KEY)
    if not isinstance(fields, dict):
        return None
    points = tuple(CapacityPoint(**p) for p in fields["capacity_points"])
    return LoadReport(**{**fields, "capacity_points": points})


def route_facts(body: bytes, headers: dict[str, str], default_rate_tps: float) -> dict[str, object]:
    """What the router may know of an OpenAI request body, before any replica parses it: the
    rate as the server reads it (body `stream_rate`, else X-Stream-Rate, else the default),
    the prompt's size in tokens (estimated from characters) and max_tokens."""
    try:
        parsed = json.loads(body or b"{}")
    except ValueError:
        parsed = {}
    parsed = parsed if isinstance(parsed, dict) else {}
    rate = _number(parsed.get("stream_rate")) or _number(headers.get("x-stream-rate"))
    stream_class = parsed.get("stream_class") or headers.get("x-stream-class") or "reader"
    consumption = Consumption.READER if stream_class == "reader" else Consumption.EAGER
    max_tokens = _number(parsed.get("max_completion_tokens")) or _number(parsed.get("max_tokens"))
    facts = route_request(
        uuid.uuid4().hex,
        rate or default_rate_tps,
        _prompt_tokens(parsed),
        int(max_tokens or DEFAULT_MAX_TOKENS),
        consumption,
    )
    return asdict(facts)


def facts_to_route_request(facts: object) -> RouteRequest | None:
    """The RouteRequest of a handle call's first argument, if it carries one."""
    if not isinstance(facts, dict) or "lifetime_tokens" not in facts:
        return None
    return RouteRequest(**facts)


def _number(value: object) -> float | None:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and number > 0 else None


def _prompt_tokens(parsed: dict[str, object]) -> int:
    prompt = parsed.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if prompt is not None:
        return len(str(prompt)) // _CHARS_PER_TOKEN + 1
    messages = parsed.get("messages")
    text = json.dumps(messages) if isinstance(messages, list) else ""
    return len(text) // _CHARS_PER_TOKEN + 1
