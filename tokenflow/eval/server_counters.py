"""What a server counted during a benchmark run: preemptions, KV reloads and recomputes, read
from its Prometheus `/metrics` before and after the run.

A client cannot see a preemption: a paused stream is only a gap between tokens.  The server's
own counters can, so a benchmark reads them around the run and reports the difference.  The
names are TokenFlow's and vLLM's (`vllm:num_preemptions`), so the same table holds either
server; a server that exports none of them gives None, shown as "n/a", not 0.
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families

# What the report calls each counter -> the metric families that count it (without `_total`,
# as the parser names them).
COUNTERS: Mapping[str, tuple[str, ...]] = {
    "preemptions": ("tokenflow_preemptions", "vllm:num_preemptions"),
    "kv_loads": ("tokenflow_kv_loads",),
    "recomputes": ("tokenflow_recomputes",),
}


def parse_counters(text: str) -> dict[str, float]:
    """The `COUNTERS` a Prometheus text exposition holds, each summed over its labels (vLLM
    labels by model and engine); a counter the text lacks is absent."""
    families = {family.name: family for family in text_string_to_metric_families(text)}
    found: dict[str, float] = {}
    for key, names in COUNTERS.items():
        for name in names:
            if name in families:
                samples = families[name].samples
                found[key] = sum(s.value for s in samples if s.name.endswith("_total"))
                break
    return found


async def read_counters(http: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    """The server's counters now (empty when it has no /metrics or it cannot be read);
    `http` carries the API key, which a server with keys asks of /metrics too."""
    try:
        response = await http.get(f"{base_url.rstrip('/')}/metrics", timeout=10.0)
    except httpx.HTTPError:
        return {}
    if response.status_code != 200:
        return {}
    try:
        return parse_counters(response.text)
    except ValueError:  # not a Prometheus exposition
        return {}


def counted_during(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, int]:
    """What each counter read both times counted in between."""
    return {key: int(after[key] - before[key]) for key in after if key in before}
