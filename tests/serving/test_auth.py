"""Who may use /v1: every listed key (flags, key file, class rules), checked in constant time on
the headers alone, before the body is read."""

from __future__ import annotations

import httpx
import pytest

from tests.serving.fake_engine import FakeEngine
from tokenflow.cli.server_options import server_config_from
from tokenflow.serving.app import build_app
from tokenflow.serving.auth import ApiKeys, bearer_token, read_key_file
from tokenflow.serving.config import ServerConfig

pytestmark = pytest.mark.anyio

COMPLETIONS = "/v1/completions"
BODY = {"prompt": "x", "max_tokens": 1}


async def statuses(config: ServerConfig, *requests: dict) -> list[int]:
    """The status of each request: {"headers": ..., "content" or "json": ...}."""
    transport = httpx.ASGITransport(app=build_app(FakeEngine(), config))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        return [(await http.post(COMPLETIONS, **request)).status_code for request in requests]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_every_key_given_is_accepted_and_no_other(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# tenants\nfile-key-1\n\n  file-key-2  \n")
    config = ServerConfig(
        api_keys=("flag-key-1", "flag-key-2"),
        api_key_file=str(key_file),
        api_key_classes=("chat-key=reader:6",),
    )
    keys = ("flag-key-1", "flag-key-2", "file-key-1", "file-key-2", "chat-key")
    got = await statuses(config, *({"json": BODY, "headers": bearer(k)} for k in keys))
    assert got == [200] * 5
    refused = await statuses(config, {"json": BODY}, {"json": BODY, "headers": bearer("flag-key")})
    assert refused == [401, 401]


async def test_without_any_key_the_server_is_open():
    got = await statuses(ServerConfig(), {"json": BODY}, {"json": BODY, "headers": bearer("any")})
    assert got == [200, 200]


async def test_a_request_without_a_key_is_refused_before_its_body_is_parsed():
    config = ServerConfig(api_keys=("k",))
    malformed = {"content": b"{not json", "headers": {"content-type": "application/json"}}
    assert await statuses(config, malformed) == [401]
    keyed = {**malformed, "headers": {**malformed["headers"], **bearer("k")}}
    assert await statuses(config, keyed) == [400]


async def test_the_bearer_scheme_is_matched_in_any_case():
    config = ServerConfig(api_keys=("k",))
    schemes = ("bearer k", "BEARER k", "Bearer  k ")
    got = await statuses(
        config, *({"json": BODY, "headers": {"Authorization": s}} for s in schemes)
    )
    assert got == [200, 200, 200]
    assert bearer_token("Basic k") is None and bearer_token("Bearer") is None


def test_keys_are_compared_in_constant_time_against_every_key(monkeypatch):
    import hmac

    compared: list[bytes] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append(b)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    keys = ApiKeys(["first", "second", "third"])
    assert keys.accepts("Bearer first")  # a match on the first key still compares all three
    assert compared == [b"first", b"second", b"third"]


def test_a_key_file_without_keys_or_unreadable_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        read_key_file(str(empty))
    with pytest.raises(ValueError, match="cannot read the API key file"):
        ServerConfig(api_key_file=str(tmp_path / "missing"))


def test_repeated_api_key_flags_and_a_config_file_string_both_work(tmp_path):
    import argparse

    from tokenflow.cli.config_file import add_config_argument, apply_config_file
    from tokenflow.cli.serve_options import add_serve_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_serve_arguments(parser)
    args = parser.parse_args(["--api-key", "a", "--api-key", "b"])
    assert server_config_from(args).allowed_keys == ("a", "b")
    config = tmp_path / "serve.toml"
    config.write_text('api-key = "from-file"\n')
    add_config_argument(parser)
    argv = ["--config", str(config)]
    apply_config_file(parser, argv)
    assert server_config_from(parser.parse_args(argv)).allowed_keys == ("from-file",)


async def test_the_docs_pages_that_load_a_cdn_are_off():
    transport = httpx.ASGITransport(app=build_app(FakeEngine()))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        assert (await http.get("/docs")).status_code == 404
        assert (await http.get("/redoc")).status_code == 404
        assert (await http.get("/openapi.json")).status_code == 200


def test_one_key_cannot_hold_more_requests_than_its_bound():
    import threading

    from tests.serving.live_server import serve_in_thread

    gate = threading.Event()
    engine = FakeEngine(gate=gate, gate_at_token=1)  # the first stream waits at its 2nd token
    config = ServerConfig(api_keys=("a", "b"), max_requests_per_key=1)
    body = {"prompt": "x", "max_tokens": 3, "stream": True}
    with serve_in_thread(build_app(engine, config)) as url, httpx.Client(timeout=60) as http:
        with http.stream("POST", url + COMPLETIONS, json=body, headers=bearer("a")) as first:
            assert first.status_code == 200  # headers at once: the stream is in flight
            second = http.post(url + COMPLETIONS, json=BODY, headers=bearer("a"))
            with http.stream("POST", url + COMPLETIONS, json=body, headers=bearer("b")) as other:
                assert other.status_code == 200  # another key has its own bound
                gate.set()
                other.read()
            first.read()
        again = http.post(url + COMPLETIONS, json=BODY, headers=bearer("a"))
    assert second.status_code == 429 and second.headers["retry-after"] == "1"
    assert second.json()["error"]["code"] == "rate_limit_exceeded"
    assert again.status_code == 200  # the stream's last byte was sent: the slot is free
