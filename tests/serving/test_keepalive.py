"""Accepted streams send their headers at once and keep-alives (blank lines) while they wait;
refusals stay real status codes; the clients users bring (the openai SDK, httpx-sse, litellm;
`vllm bench serve` in tests_vllm) parse such streams unchanged.

The fake engine holds a stream's token at a gate that the client opens only once it has read
the keep-alives it expects, so the tests wait on what the server sent, never on a delay."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator

import httpx
import openai

from tests.serving.fake_engine import FakeEngine
from tests.serving.live_server import serve_in_thread
from tokenflow.serving.app import KEEPALIVE as KEEPALIVE_BYTES
from tokenflow.serving.app import _keepalive, _to_response, build_app
from tokenflow.serving.config import ServerConfig

KEEPALIVE = ServerConfig(keepalive_s=0.05)
TIMEOUT_S = 60  # a hang guard: each read returns within one keep-alive interval


def num_keepalives(text: str) -> int:
    """Blank lines beyond the frames' own: the keep-alives in `text`."""
    return re.sub(r"data: [^\n]*\n\n", "", text).count("\n")


class _Watched(httpx.SyncByteStream):
    """A response body that opens `gate` once `count` keep-alives followed the last data frame."""

    def __init__(self, inner: httpx.SyncByteStream, gate: threading.Event, count: int) -> None:
        self._inner, self._gate, self._count = inner, gate, count
        self._seen = b""

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._inner:
            self._seen += chunk
            since_data = self._seen.rpartition(b"data: ")[2].decode(errors="replace")
            if num_keepalives("data: " + since_data) >= self._count:
                self._gate.set()
            yield chunk

    def close(self) -> None:
        self._inner.close()


class OpenAfterKeepalives(httpx.BaseTransport):
    """HTTP transport whose responses open `gate` after `count` keep-alives in a row."""

    def __init__(self, gate: threading.Event, count: int) -> None:
        self._inner = httpx.HTTPTransport()
        self._gate, self._count = gate, count

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._inner.handle_request(request)
        assert isinstance(response.stream, httpx.SyncByteStream)
        body = _Watched(response.stream, self._gate, self._count)
        return httpx.Response(response.status_code, headers=response.headers, stream=body)

    def close(self) -> None:
        self._inner.close()


def gated_client(gate: threading.Event, count: int) -> httpx.Client:
    return httpx.Client(transport=OpenAfterKeepalives(gate, count), timeout=TIMEOUT_S)


def test_headers_at_once_then_keepalives_until_the_first_token() -> None:
    gate = threading.Event()
    engine = FakeEngine(gate=gate)  # no token until the client has read 3 keep-alives
    with serve_in_thread(build_app(engine, KEEPALIVE)) as url, gated_client(gate, 3) as http:
        body = {"prompt": "x", "max_tokens": 2, "stream": True}
        with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            assert not gate.is_set()  # the headers came while no token existed
            text = "".join(response.iter_text())
    head, _, rest = text.partition("data: ")
    assert num_keepalives(head) >= 3 and head.replace("\n", "") == ""
    assert rest.endswith("data: [DONE]\n\n") and '"finish_reason":"length"' in rest


def test_refusals_stay_status_codes_for_streams() -> None:
    engine = FakeEngine(max_num_requests=0)
    with serve_in_thread(build_app(engine, KEEPALIVE)) as url:
        body = {"prompt": "x", "max_tokens": 2, "stream": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=10).status_code == 429
        long = {**body, "prompt": "x " * 300}
        assert httpx.post(f"{url}/v1/completions", json=long, timeout=10).status_code == 400


def test_official_client_parses_streams_with_keepalives() -> None:
    gate = threading.Event()
    engine = FakeEngine(gate=gate, eos_after=3)
    with serve_in_thread(build_app(engine, KEEPALIVE)) as url, gated_client(gate, 2) as http:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, http_client=http)
        chat = client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        chunks = list(chat)
    assert gate.is_set()  # the client read two keep-alives before the first token
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == " t0 t1 t2"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_keepalives_fill_a_pause_between_tokens() -> None:
    # A stream paused by preemption looks like this to the server: no delta for a while.
    gate = threading.Event()
    engine = FakeEngine(gate=gate, gate_at_token=1)
    with serve_in_thread(build_app(engine, KEEPALIVE)) as url, gated_client(gate, 2) as http:
        body = {"prompt": "x", "max_tokens": 2, "stream": True}
        text = http.post(f"{url}/v1/completions", json=body).text
    first, _, rest = text.partition('"finish_reason":null')
    between, _, _ = rest.partition("data: ")  # from the first token's frame to the second's
    assert num_keepalives(between) >= 2 + 2  # the first frame's own blank line ends it
    assert text.endswith("data: [DONE]\n\n")


def test_keepalives_are_on_by_default_as_blank_lines() -> None:
    """Within a proxy's idle timeout (nginx: 60 s) by default, and a bare blank line: an SSE
    comment at the end of a network read made `vllm bench serve` drop the rest of the stream
    (it strips each read before splitting it into events)."""

    async def no_events():
        yield "[DONE]"

    assert 0 < ServerConfig().keepalive_s <= 15
    assert _to_response(no_events(), ServerConfig()).ping_interval == ServerConfig().keepalive_s
    assert _keepalive().encode() == KEEPALIVE_BYTES == b"\n"
    assert _to_response(no_events(), ServerConfig(keepalive_s=0)).ping_interval == 0


def test_httpx_sse_parses_streams_with_keepalives() -> None:
    from httpx_sse import connect_sse

    gate = threading.Event()
    engine = FakeEngine(gate=gate, eos_after=3)
    with serve_in_thread(build_app(engine, KEEPALIVE)) as url, gated_client(gate, 2) as http:
        body = {"prompt": "x", "max_tokens": 5, "stream": True}
        with connect_sse(http, "POST", f"{url}/v1/completions", json=body) as source:
            data = [event.data for event in source.iter_sse()]
    assert gate.is_set() and data[-1] == "[DONE]"
    texts = [json.loads(d)["choices"][0]["text"] for d in data[:-1]]
    assert "".join(texts) == " t0 t1 t2"


def test_litellm_parses_streams_with_keepalives() -> None:
    import litellm

    gate = threading.Event()
    engine = FakeEngine(gate=gate, eos_after=3)
    with serve_in_thread(build_app(engine, KEEPALIVE)) as url, gated_client(gate, 2) as http:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, http_client=http)
        stream = litellm.completion(
            model="openai/fake-model",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            client=client,  # litellm's own stream wrapper over this transport
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert gate.is_set()  # two keep-alives came before the first token
    assert text == " t0 t1 t2"


def test_a_client_that_reads_nothing_is_cut_off_and_its_request_aborted() -> None:
    import socket

    from tests.serving.live_server import wait_until

    # ~8 MB of answer against a client whose receive buffer is 4 KiB and that never reads:
    # the server's sends block once the socket buffers are full, and the send timeout ends it.
    engine = FakeEngine(max_model_len=3_000_000, tokens_per_delta=20_000)
    config = ServerConfig(keepalive_s=0, send_timeout_s=0.5)
    body = json.dumps({"prompt": "x", "max_tokens": 1_000_000, "stream": True}).encode()
    with serve_in_thread(build_app(engine, config)) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            )
            sock.sendall(head.encode() + body)
            assert wait_until(lambda: engine.aborted_ids, timeout_s=120)
    assert engine.num_finished == 0  # cut off mid-way, not run to its end
