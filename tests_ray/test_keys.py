"""The fleet's per-key limits (`keys.py`), without a cluster: the ingress holds the limits the
replicas' options set, the replicas hold none, and a request's work is its routing facts'."""

import asyncio

import pytest

from tokenflow.replicas.deployments import server_config
from tokenflow.replicas.keys import ingress_gate, replica_config, starts_work, work_of
from tokenflow.replicas.reports import facts_to_route_request, route_facts
from tokenflow.serving.classes import ClassRules
from tokenflow.serving.tenants import Work
from tokenflow.serving.validation import ApiError

ARGV = ["--api-key", "k", "--max-requests-per-key", "2", "--max-tokens-per-key", "1000"]


def test_the_replicas_hold_no_per_key_limit_and_the_ingress_holds_theirs():
    config = server_config(ARGV)
    replica = replica_config(config)
    assert (replica.max_requests_per_key, replica.max_tokens_per_key) == (0, 0)
    assert replica.allowed_keys == config.allowed_keys  # (the keys are still asked for)
    limits = ingress_gate(config).ledger.limits
    assert (limits.max_choices, limits.max_tokens, limits.capacity_choices) == (2, 1000, 0)


def test_the_ingress_gate_refuses_at_once_and_never_makes_a_request_wait():
    gate = ingress_gate(server_config(ARGV))

    async def three():
        first = await gate.admit("k", Work(1, 10))
        await gate.admit("k", Work(1, 10))
        with pytest.raises(ApiError) as refused:
            await gate.admit("k", Work(1, 10))  # (at once: no wait for room)
        first.release(10)
        await gate.admit("k", Work(1, 10))  # room again
        return refused.value

    refused = asyncio.run(three())
    assert refused.status_code == 429 and refused.body().error.code == "rate_limit_exceeded"


def test_a_requests_work_is_each_choice_holding_its_prompt_and_max_tokens():
    body = {"prompt": ["x" * 40, "y" * 40], "max_tokens": 20, "n": 3}
    facts = route_facts(body, {}, ClassRules(), 4.0)
    assert work_of(facts_to_route_request(facts)) == Work(6, 6 * (11 + 20))


def test_only_a_generation_starts_work():
    assert starts_work("POST", "/v1/completions") and starts_work("POST", "/v1/chat/completions")
    assert not starts_work("GET", "/v1/models") and not starts_work("POST", "/tokenize")
    assert not starts_work("GET", "/v1/completions")
