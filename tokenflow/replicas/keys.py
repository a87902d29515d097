"""Each API key's limits in a fleet: held once, fleet-wide, by the ingress.

`tokenflow serve` bounds each key's work in flight (`serving.tenants.KeyGate`: completions by
--max-requests-per-key, tokens by --max-tokens-per-key).  Were each replica to hold those bounds,
each would count only what reaches it, and a key would get its limit once per replica.  So the
ingress, which every request passes, holds them (`ingress_gate`, from the very server options
the replicas get), and the replicas hold none (`replica_config`).  (A replica's 429 of a per-key
limit, were one to come, is never offered to another replica: `guards.can_go_elsewhere`.)

The ingress has no tokenizer: a request's `Work` is the router's estimate of it
(`reports.route_facts`): its choices (prompts x `n`), each holding its prompt (text at 4
characters a token, a token-id list its length) and its `max_tokens` (`max_completion_tokens`),
or `reports.DEFAULT_MAX_TOKENS` where the body states none (the ingress does not know the
model's context length).  A generation is admitted before it is forwarded (429 naming the
limit, which no replica sees) and released when its relay ends (its last byte, its client gone,
or a refusal passed on), charged with its whole estimate.  A continuation of a moved answer is
the same request, covered by its admission: it is never admitted again.  With more than one
ingress replica (Serve runs one), each would hold the limits for what passes it.
"""

# No `from __future__ import annotations`, as in ingress.py (Ray pickles the ingress).
from dataclasses import replace

from tokenflow.core.load_report import RouteRequest
from tokenflow.serving.config import ServerConfig
from tokenflow.serving.tenants import Admission, KeyGate, Work

# The requests that start engine work, so take an admission (a POST to one of these paths).
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def ingress_gate(config: ServerConfig) -> KeyGate:
    """The gate of the fleet's per-key limits: `config`'s, the server options the replicas
    get.  It shares no engine slots (each replica shares its own engine's between keys): it
    never makes a request wait, it admits or refuses."""
    return KeyGate(config.key_limits())


def replica_config(config: ServerConfig) -> ServerConfig:
    """`config` as an engine replica behind the ingress runs it: without per-key limits (the
    ingress holds them fleet-wide), so a replica never refuses a request, or the continuation
    of a moved answer, by its key's limit."""
    return replace(config, max_requests_per_key=0, max_tokens_per_key=0)


def starts_work(method: str, path: str) -> bool:
    """Whether a request starts engine work, so counts against its key: a generation."""
    return method == "POST" and path in GENERATION_PATHS


def work_of(route: RouteRequest) -> Work:
    """A request's work by its routing facts: each choice holds its prompt and max_tokens."""
    return Work(num_choices=route.num_choices, num_tokens=route.num_choices * route.end_tokens)


def end(admission: Admission | None) -> None:
    """A request's answer ended: its admission (None: it took none) is released, charged
    with its whole estimate (the ingress counts no tokens)."""
    if admission is not None:
        admission.release(admission.work.num_tokens)
