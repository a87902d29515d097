"""Consumption classes: how a request's class and rate are found (serving/classes.py)."""

from __future__ import annotations

import math

import httpx
import pytest

from tests.serving.fake_engine import FakeEngine
from tokenflow.cli.server_options import server_config_from
from tokenflow.core.request import Consumption
from tokenflow.serving.app import build_app
from tokenflow.serving.classes import ClassRules
from tokenflow.serving.config import ServerConfig

pytestmark = pytest.mark.anyio
BODY = {"prompt": "x", "max_tokens": 1, "stream": True}


async def rates(config: ServerConfig, *posts: tuple[dict, dict]) -> list[float]:
    """The rate the engine got for each (body, headers) posted, or the HTTP status."""
    engine = FakeEngine()
    transport = httpx.ASGITransport(app=build_app(engine, config))
    results: list[float] = []
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        for body, headers in posts:
            response = await http.post("/v1/completions", json=body, headers=headers)
            if response.status_code != 200:
                results.append(response.status_code)
            else:
                results.append(engine.submitted[-1][2])
    return results


async def test_a_non_streamed_request_is_batch_and_reads_at_once():
    batch = {**BODY, "stream": False}
    got = await rates(ServerConfig(), (batch, {}), ({**batch, "stream_class": "batch"}, {}))
    assert got == [math.inf, math.inf]


async def test_the_engine_gets_each_requests_class():
    engine = FakeEngine()
    transport = httpx.ASGITransport(app=build_app(engine, ServerConfig()))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        for body in ({**BODY, "stream": False}, BODY, {**BODY, "stream_rate": 3}):
            assert (await http.post("/v1/completions", json=body)).status_code == 200
    assert engine.consumptions == [Consumption.BATCH, Consumption.EAGER, Consumption.READER]


async def test_an_eager_stream_by_body_or_header_and_the_body_wins():
    got = await rates(
        ServerConfig(),
        ({**BODY, "stream_class": "eager"}, {}),
        (BODY, {"X-Stream-Class": "eager"}),
        ({**BODY, "stream_class": "reader"}, {"X-Stream-Class": "eager", "X-Stream-Rate": "3"}),
        (BODY, {"X-Stream-Rate": "5"}),  # a stated rate: a reader
    )
    assert got == [math.inf, math.inf, 3.0, 5.0]


async def test_unknown_or_contradictory_classes_are_a_400():
    got = await rates(
        ServerConfig(),
        ({**BODY, "stream_class": "robot"}, {}),
        (BODY, {"X-Stream-Class": "robot"}),
        ({**BODY, "stream_class": "batch"}, {}),  # batch is not streamed
        ({**BODY, "stream": False, "stream_class": "eager"}, {}),
    )
    assert got == [400, 400, 400, 400]


async def test_a_refused_class_is_a_400_naming_the_field():
    transport = httpx.ASGITransport(app=build_app(FakeEngine(), ServerConfig()))
    refused = []
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        for body, headers in (
            (BODY, {"X-Stream-Class": "robot"}),  # (the body's own is checked by its type)
            ({**BODY, "stream_class": "batch"}, {}),
            ({**BODY, "stream": False, "stream_class": "eager"}, {}),
        ):
            response = await http.post("/v1/completions", json=body, headers=headers)
            error = response.json()["error"]
            refused.append((response.status_code, error["message"], error["param"]))
    unknown = "unknown stream class 'robot'; choose one of reader, eager, batch"
    assert refused == [
        (400, unknown, "stream_class"),
        (400, "stream_class batch is for stream: false", "stream_class"),
        (400, "stream_class eager needs stream: true", None),
    ]


async def test_classes_by_api_key_and_the_server_default():
    config = ServerConfig(
        api_keys=("other",),
        default_class="eager",
        api_key_classes=("chat-key=reader:6", "voice-key=reader"),
    )
    got = await rates(
        config,
        (BODY, {"Authorization": "Bearer chat-key"}),
        (BODY, {"Authorization": "Bearer voice-key"}),  # a reader at the default rate
        (BODY, {"Authorization": "Bearer other"}),  # a key without a rule: the default
        (BODY, {}),  # (a class rule's key turns auth on)
    )
    assert got == [6.0, FakeEngine().default_rate_tps, math.inf, 401]


async def test_a_keys_rule_binds_what_its_requests_state_unless_written_with_a_tilde():
    config = ServerConfig(api_key_classes=("chat-key=reader:6", "agents-key=~eager"))
    chat = {"Authorization": "Bearer chat-key"}
    agents = {"authorization": "bearer agents-key"}  # the scheme in any case
    got = await rates(
        config,
        ({**BODY, "stream_rate": 500}, chat),  # a tenant cannot raise its own rate
        ({**BODY, "stream_class": "eager"}, chat),  # nor leave its class
        (BODY, {**chat, "X-Stream-Rate": "50"}),
        (BODY, agents),
        ({**BODY, "stream_rate": 2}, agents),  # a default: the stated rate wins
    )
    assert got == [6.0, 6.0, 6.0, math.inf, 2.0]


def test_class_rules_refuse_what_they_cannot_read():
    bad_rules = ("key",), ("key=",), ("key=robot",), ("key=eager:3",), ("key=reader:0",)
    for bad in (*bad_rules, ("key=reader:1e-309",), ("key=reader:5000",)):
        with pytest.raises(ValueError):
            ClassRules.parse("reader", bad)
    with pytest.raises(ValueError, match="unknown stream class"):
        ServerConfig(default_class="robot")


def test_the_class_rules_come_from_a_config_file_too(tmp_path):
    import argparse

    from tokenflow.cli.config_file import ConfigFileError, add_config_argument, apply_config_file
    from tokenflow.cli.serve_options import add_serve_arguments

    path = tmp_path / "serve.toml"
    path.write_text('default_class = "eager"\napi_key_class = ["chat-key=reader:6"]\n')
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    add_config_argument(parser)
    argv = ["--config", str(path)]
    apply_config_file(parser, argv)
    config = server_config_from(parser.parse_args(argv))
    assert config.class_rules.default.consumption.value == "eager"
    assert config.class_rules.by_api_key["chat-key"].rate_tps == 6.0
    path.write_text("api_key_class = 6\n")
    with pytest.raises(ConfigFileError, match="a list of strings"):
        apply_config_file(parser, argv)
