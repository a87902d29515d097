"""Hostile clients against the Ray ingress, through Serve's HTTP proxy, with two fake replicas
(`fakes.py`) that record what reaches them: the ingress refuses what it must before any replica
sees it (a key past its limit, fleet-wide, among them), offers a full replica's 429 to the other
replica but never a per-key limit's, cancels a stream whose client left, asks the key on its
own routes too; Ray itself is on the loopback with its token authentication on."""

import contextlib
import json
import socket

import httpx
import pytest
import ray
from ray import serve

from tests_ray.fakes import CHUNKS, FAKE, NAMESPACE, RECORDER, STREAM_ID, FakeReplica, Recorder
from tests_ray.fleet import until
from tokenflow.eval.local_server import free_port
from tokenflow.replicas.guards import MAX_TRIES
from tokenflow.replicas.ingress import REPLICA_HEADER
from tokenflow.replicas.launch import APP_NAME, build_application, start_serve, stop_serve

KEY = "test-key-1234"
LIMITED_KEY = "test-key-at-its-limit"  # (its own key: the other tests' requests do not count)
LIMIT = 8192  # --max-body-bytes
PER_KEY = 2  # --max-requests-per-key: completions in flight per key, fleet-wide
GOOD = {"prompt": "hi", "max_tokens": 4, "stream": True}


@pytest.fixture(scope="module")
def port():
    port = free_port()
    start_serve("127.0.0.1", port, num_cpus=2, object_store_mib=128)
    recorder = Recorder.options(name=RECORDER, namespace=NAMESPACE).remote()
    ray.get(recorder.state.remote())  # (up, and held here: an actor nobody holds is collected)
    serve_argv = ["--api-key", KEY, "--api-key", LIMITED_KEY, "--max-body-bytes", str(LIMIT)]
    serve_argv += ["--max-requests-per-key", str(PER_KEY)]
    application = build_application(2, "tokenflow", serve_argv, 0.5, replica_class=FakeReplica)
    serve.run(application, name=APP_NAME, route_prefix="/")
    yield port
    stop_serve()


@pytest.fixture
def recorder(port):
    recorder = ray.get_actor(RECORDER, namespace=NAMESPACE)
    ray.get(recorder.reset.remote())
    return recorder


def _state(recorder) -> dict:
    return ray.get(recorder.state.remote())


def _post(port: int, body: bytes, key: str | None = KEY, **headers: str) -> httpx.Response:
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    headers["content-type"] = "application/json"
    url = f"http://127.0.0.1:{port}/v1/completions"
    return httpx.post(url, content=body, headers=headers, timeout=60)


def _answer_while_sending(port: int, head: str, body_part: bytes) -> bytes:
    """The answer's head to a request of which only `head` and `body_part` were sent (the
    rest never is): what the ingress says before it has the whole body."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(head.encode() + body_part)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def _head(**headers: str) -> str:
    lines = [
        "POST /v1/completions HTTP/1.1",
        "Host: 127.0.0.1",
        f"Authorization: Bearer {KEY}",
        "Content-Type: application/json",
    ]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return "\r\n".join(lines) + "\r\n\r\n"


def _error(response: httpx.Response) -> dict:
    return response.json()["error"]


def test_a_body_declared_too_large_is_refused_before_it_is_sent(port, recorder):
    answer = _answer_while_sending(port, _head(Content_Length=str(100 << 20)), b"{" * 1024)
    assert answer.startswith(b"HTTP/1.1 413")
    assert _state(recorder)["calls"] == []


def test_a_chunked_body_is_refused_once_it_passes_the_limit(port, recorder):
    chunk = b"%x\r\n%s\r\n" % (4096, b" " * 4096)
    answer = _answer_while_sending(port, _head(Transfer_Encoding="chunked"), chunk * 3)
    assert answer.startswith(b"HTTP/1.1 413")  # 12 KiB of a body that never ends
    assert _state(recorder)["calls"] == []


def test_the_413_has_the_servers_error_shape(port, recorder):
    response = _post(port, b" " * (LIMIT + 1))
    assert response.status_code == 413 and _error(response)["code"] == "too_large"


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 5000,  # a nesting bomb: RecursionError in the parser
        b'{"a":' * 1500,
        b'{"prompt": "\xff\xfe"}',  # invalid UTF-8
        b"[1, 2, 3]",  # JSON, not an object
        b'"prompt"',
        b'{"max_tokens": ' + b"9" * 5000 + b"}",
    ],
    ids=["array-bomb", "object-bomb", "bad-utf8", "array", "string", "huge-int"],
)
def test_a_body_that_is_not_a_json_object_is_a_400_no_replica_sees(port, recorder, body):
    response = _post(port, body)
    assert response.status_code == 400
    assert _error(response)["type"] == "invalid_request_error"
    assert _state(recorder)["calls"] == []


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_a_request_without_the_key_is_a_401_before_its_body_is_parsed(port, recorder, key):
    response = _post(port, b"[" * 5000, key=key)  # (parsed, this body would be a 400)
    assert response.status_code == 401 and _error(response)["code"] == "invalid_api_key"
    assert _state(recorder)["calls"] == []


def test_a_well_formed_request_with_the_key_is_served(port, recorder):
    response = _post(port, json.dumps(GOOD).encode())
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    assert len(_state(recorder)["calls"]) == 1


def test_a_429_is_served_by_the_other_replica(port, recorder):
    responses = [_post(port, json.dumps(GOOD).encode(), **{FAKE: "busy-first"}) for _ in range(6)]
    names = _state(recorder)["names"]
    assert [r.status_code for r in responses] == [200] * 6
    assert {r.headers[REPLICA_HEADER] for r in responses} == {names[1]}
    assert 0 in _state(recorder)["calls"]  # the busy replica was asked, and refused


def test_when_every_replica_is_full_the_429_passes_through_with_retry_after(port, recorder):
    response = _post(port, json.dumps(GOOD).encode(), **{FAKE: "busy-all"})
    assert response.status_code == 429 and response.headers["retry-after"] == "2"
    assert len(_state(recorder)["calls"]) == MAX_TRIES


def test_a_per_key_429_from_a_replica_is_not_offered_to_the_other(port, recorder):
    response = _post(port, json.dumps(GOOD).encode(), **{FAKE: "key-limited"})
    assert response.status_code == 429 and _error(response)["code"] == "rate_limit_exceeded"
    assert len(_state(recorder)["calls"]) == 1


def test_a_key_at_its_limit_gets_429_from_the_ingress_and_never_more_in_flight(port, recorder):
    url = f"http://127.0.0.1:{port}/v1/completions"
    lines = []  # (each held: a reader dropped closes its stream)
    with contextlib.ExitStack() as held:
        for i in range(PER_KEY):  # streams of 20 s, held open: the key is at its limit
            headers = {"authorization": f"Bearer {LIMITED_KEY}", CHUNKS: "400", STREAM_ID: f"h{i}"}
            stream = held.enter_context(
                httpx.stream("POST", url, json=GOOD, headers=headers, timeout=60)
            )
            lines.append(stream.iter_lines())
            assert stream.status_code == 200 and next(lines[-1]).startswith("data: ")
        refused = [_post(port, json.dumps(GOOD).encode(), key=LIMITED_KEY) for _ in range(6)]
        assert [r.status_code for r in refused] == [429] * 6
        assert all(_error(r)["code"] == "rate_limit_exceeded" for r in refused)
        assert not any(REPLICA_HEADER in r.headers for r in refused)  # the ingress's answer
        assert len(_state(recorder)["calls"]) == PER_KEY  # on both replicas together
        assert _post(port, json.dumps(GOOD).encode()).status_code == 200  # (another key)
    # the held streams' clients left: their key has room again once the ingress sees it
    served = until(
        lambda: _ok(_post(port, json.dumps(GOOD).encode(), key=LIMITED_KEY)), "room for the key"
    )
    assert served.text.endswith("data: [DONE]\n\n")


def test_n_past_the_keys_limit_is_refused_before_any_replica_sees_it(port, recorder):
    for n in (PER_KEY + 1, 128, 10**9):
        body = json.dumps({**GOOD, "n": n}).encode()
        response = _post(port, body, key=LIMITED_KEY)
        assert response.status_code == 429 and _error(response)["code"] == "rate_limit_exceeded"
        assert f"may have {PER_KEY} completions" in _error(response)["message"]
    prompts = json.dumps({**GOOD, "prompt": ["a"] * (PER_KEY + 1)}).encode()
    assert _post(port, prompts, key=LIMITED_KEY).status_code == 429
    assert _state(recorder)["calls"] == []


@pytest.mark.parametrize("path", ["/replicas", "/replicas/moves"])
def test_the_ingress_own_routes_need_the_key(port, path):
    url = f"http://127.0.0.1:{port}{path}"
    refused = httpx.get(url, timeout=60)
    assert refused.status_code == 401 and _error(refused)["code"] == "invalid_api_key"
    assert httpx.get(url, headers={"authorization": f"Bearer {KEY}"}, timeout=60).status_code == 200


def _ok(response: httpx.Response) -> httpx.Response | None:
    return response if response.status_code == 200 else None


def test_a_client_that_disconnects_cancels_its_replica_stream(port, recorder):
    # (a stream of 2 minutes, so that on a busy machine the cancellation still finds it running;
    # the wait ends as soon as the replica records it)
    headers = {"authorization": f"Bearer {KEY}", CHUNKS: "2400", STREAM_ID: "left-early"}
    url = f"http://127.0.0.1:{port}/v1/completions"
    with httpx.stream("POST", url, json=GOOD, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # then the client leaves, 2 minutes early
    until(lambda: "left-early" in _state(recorder)["cancelled"], "the replica stream's cancel")


def test_ray_listens_on_the_loopback_with_its_token_authentication_on(port):
    from ray._raylet import AuthenticationMode, get_authentication_mode

    assert {node["NodeManagerAddress"] for node in ray.nodes()} == {"127.0.0.1"}
    assert get_authentication_mode() == AuthenticationMode.TOKEN
    outside = _an_outside_address()
    if outside is not None:  # Serve's proxy (--host 127.0.0.1) is not on another interface
        with pytest.raises(OSError), socket.create_connection((outside, port), timeout=5):
            pass


def _an_outside_address() -> str | None:
    """This machine's address on its default route, if it has one other than the loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))  # (a UDP connect sends nothing)
        except OSError:
            return None
        address = sock.getsockname()[0]
    return None if address.startswith("127.") else address
