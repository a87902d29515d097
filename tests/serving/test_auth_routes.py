"""Which routes need a key: with keys, every one but /health and the /dashboard page (and
/metrics with --public-metrics); which keys turn auth on; the start-up line that says so."""

from __future__ import annotations

import httpx
import pytest

from tests.serving.fake_engine import FakeEngine
from tokenflow.serving.app import build_app
from tokenflow.serving.config import ServerConfig

pytestmark = pytest.mark.anyio

MODEL_BODY = {"model": "fake-model"}
# (method, path, body): every route of the app that a key must guard, and one that is no route.
GUARDED = [
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/tokenflow/streams", None),
    ("POST", "/tokenize", {**MODEL_BODY, "prompt": "a b"}),
    ("POST", "/detokenize", {**MODEL_BODY, "tokens": [1]}),
    ("GET", "/tokenizer_info", None),  # hands out the chat template
    ("GET", "/metrics", None),
    ("GET", "/openapi.json", None),
    ("GET", "/no-such-route", None),  # 401, not 404: no route is told to a stranger
]
OPEN = ["/health", "/dashboard"]


async def statuses(config: ServerConfig, headers: dict[str, str], paths: list) -> list[int]:
    """The status of each (method, path, body) request with `headers`."""
    transport = httpx.ASGITransport(app=build_app(FakeEngine(), config))
    got = []
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        for method, path, body in paths:
            response = await http.request(method, path, json=body, headers=headers)
            got.append(response.status_code)
    return got


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def gets(paths: list[str]) -> list:
    return [("GET", path, None) for path in paths]


async def test_with_keys_every_route_but_health_and_the_dashboard_needs_one():
    config = ServerConfig(api_keys=("k",))
    assert await statuses(config, {}, GUARDED) == [401] * len(GUARDED)
    assert await statuses(config, bearer("wrong"), GUARDED) == [401] * len(GUARDED)
    with_key = await statuses(config, bearer("k"), GUARDED)
    assert with_key == [200] * (len(GUARDED) - 1) + [404]
    assert await statuses(config, {}, gets(OPEN)) == [200, 200]


async def test_metrics_needs_no_key_only_with_public_metrics():
    config = ServerConfig(api_keys=("k",), public_metrics=True)
    assert await statuses(config, {}, gets(["/metrics", *OPEN])) == [200, 200, 200]
    assert await statuses(config, {}, gets(["/tokenizer_info", "/openapi.json"])) == [401, 401]


async def test_an_open_server_serves_every_route_without_a_key():
    got = await statuses(ServerConfig(), {}, GUARDED)
    assert got == [200] * (len(GUARDED) - 1) + [404]


async def test_a_class_rules_key_alone_turns_auth_on():
    config = ServerConfig(api_key_classes=("chat-key=reader:6",))
    assert config.allowed_keys == ("chat-key",)
    completion = GUARDED[:1]
    assert await statuses(config, {}, completion) == [401]
    assert await statuses(config, bearer("any"), completion) == [401]
    assert await statuses(config, bearer("chat-key"), completion) == [200]


async def test_an_admin_key_is_an_accepted_key():
    config = ServerConfig(api_keys=("tenant",), admin_api_keys=("ops",))
    assert config.allowed_keys == ("tenant", "ops")
    assert await statuses(config, bearer("ops"), GUARDED[:3]) == [200, 200, 200]
    assert ServerConfig(admin_api_keys=("ops",)).allowed_keys == ("ops",)  # turns auth on
    with pytest.raises(ValueError, match="must not be empty"):
        ServerConfig(admin_api_keys=(" ",))


def test_the_auth_summary_says_on_or_off_how_many_keys_and_the_default_class():
    assert ServerConfig().auth_summary() == (
        "auth off: every request is served (no --api-key), default class eager"
    )
    config = ServerConfig(
        api_keys=("a", "b"),
        admin_api_keys=("ops",),
        api_key_classes=("chat=reader:6", "a=eager"),
        default_class="reader",
    )
    assert config.auth_summary() == (
        "auth on: 4 API keys (1 admin), /metrics needs a key, default class reader"
    )
    one = ServerConfig(api_key_classes=("chat=reader:6",), public_metrics=True)
    assert one.auth_summary() == "auth on: 1 API key, /metrics public, default class eager"
