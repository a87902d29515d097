"""A replica that leaves hands its streams to the other (two replicas of the embedded model on
Ray Serve, one engine thread each, on this CPU): greedy answers in flight on it go on from the
other replica in the response their clients hold, each the very text of an undisturbed run,
one id, one usage over every token, one [DONE]; the drain takes the time of the exports, not
of the answers."""

import itertools
import json
import threading
import time

import httpx
import pytest

from tests_ray.fleet import running_fleet
from tokenflow.replicas.deployments import REPLICA_HEADER
from tokenflow.replicas.launch import leave

KEY = "live-moves-key"
AUTH = {"authorization": f"Bearer {KEY}"}
DRAIN_TIMEOUT_S = 60
SERVE_ARGV = ["--num-threads", "1", "--device-kv-tokens", "1024", "--host-kv-tokens", "4096"]
SERVE_ARGV += ["--api-key", KEY, "--drain-timeout-s", str(DRAIN_TIMEOUT_S)]
# Greedy text is the same whatever a step's batch holds only on batch-invariant kernels: this
# CPU's default ones (bfloat16, 4-bit projections) pick a path by the number of rows, and an
# answer's token 15 already differed between a batch of two and a run alone; float32 does not.
SERVE_ARGV += ["--dtype", "float32"]
MAX_TOKENS = 96
COMMON = {"max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS, "ignore_eos": True}
COMMON |= {"temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def _chat(content: str) -> tuple[str, dict]:
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": content}], **COMMON}


ANSWERS = [
    ("/v1/completions", {"prompt": "Once upon a time", **COMMON}),
    ("/v1/completions", {"prompt": "The three largest cities of Europe are", **COMMON}),
    _chat("Write a short poem about the sea."),
    _chat("How do plants make their food?"),
]


@pytest.fixture(scope="module")
def fleet():
    """The application's URL and the signal that drains its replicas."""
    with running_fleet(SERVE_ARGV) as running:
        yield running


def _answer(url: str, path: str, body: dict, rate: float, out: dict, first: threading.Event):
    """One streamed answer read to its end: its status, first replica and every event's data."""
    out.update(events=[], times_s=[], replica=None, status=None)
    body = {**body, "stream_rate": rate}
    with httpx.stream("POST", url + path, json=body, headers=AUTH, timeout=600) as response:
        out["status"], out["replica"] = response.status_code, response.headers.get(REPLICA_HEADER)
        for line in response.iter_lines():
            if line.startswith("data: "):
                out["events"].append(line[6:])
                out["times_s"].append(time.monotonic())
                first.set()
    first.set()  # (also when it failed before any event: the test does not wait forever)


def _all(url: str, rate: float) -> tuple[list[dict], list[threading.Event], list[threading.Thread]]:
    results = [{} for _ in ANSWERS]
    firsts = [threading.Event() for _ in ANSWERS]
    threads = [
        threading.Thread(target=_answer, args=(url, path, body, rate, result, first))
        for (path, body), result, first in zip(ANSWERS, results, firsts, strict=True)
    ]
    for thread in threads:
        thread.start()
    return results, firsts, threads


def _chunks(result: dict) -> list[dict]:
    return [json.loads(e) for e in result["events"] if e != "[DONE]"]


def _text(result: dict) -> str:
    parts = []
    for chunk in _chunks(result):
        for choice in chunk["choices"]:
            parts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(parts)


def _check_whole(result: dict) -> None:
    """One answer, whole: one id, no error, one usage chunk over every token, one [DONE] last,
    and (chat) one role chunk."""
    chunks = _chunks(result)
    assert result["status"] == 200 and not [c for c in chunks if "error" in c], result
    assert result["events"].count("[DONE]") == 1 and result["events"][-1] == "[DONE]"
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    usages = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usages) == 1 and usages[0]["completion_tokens"] == MAX_TOKENS
    if chunks[0]["object"] == "chat.completion.chunk":
        roles = [c for c in chunks for ch in c["choices"] if ch["delta"].get("role")]
        assert len(roles) == 1


def test_a_replica_that_leaves_hands_its_streams_over_and_every_answer_is_whole(fleet):
    url, drain_signal = fleet
    undisturbed, _, threads = _all(url, rate=1000.0)
    for thread in threads:
        thread.join(timeout=600)
    for result in undisturbed:
        _check_whole(result)

    results, firsts, threads = _all(url, rate=4.0)  # slow readers: mid-answer at the drain
    for first in firsts:
        assert first.wait(timeout=300), "an answer got no first event"
    replicas = [r["replica"] for r in results]
    victim = max(sorted(set(replicas)), key=replicas.count)  # the replica with the most
    departure = leave(drain_signal, victim, DRAIN_TIMEOUT_S)
    left_s = time.monotonic()
    for thread in threads:
        thread.join(timeout=600)
    answered_s = time.monotonic() - left_s
    moved = [r for r in results if r["replica"] == victim]
    gaps = [max(b - a for a, b in itertools.pairwise(r["times_s"])) for r in moved]
    print(
        f"\n{len(moved)} of {len(results)} answers on the leaving replica: {departure}; "
        f"the answers ended {answered_s:.1f} s after the drain; the longest gap between two "
        f"events of each moved answer: {', '.join(f'{g:.2f} s' for g in gaps)}"
    )

    assert departure.is_drained and departure.num_handed_off >= 1
    assert departure.elapsed_s < DRAIN_TIMEOUT_S / 4  # the exports, not the answers' length
    for result, before in zip(results, undisturbed, strict=True):
        _check_whole(result)
        assert _text(result) == _text(before)  # not a token lost, repeated or changed
    after: dict = {}
    _answer(url, *ANSWERS[0], 1000.0, after, threading.Event())  # the other replica serves on
    assert after["replica"] != victim
    _check_whole(after)
