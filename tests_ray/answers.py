"""Greedy streamed answers for the live tests of moves, each read to its end by a client thread,
and the check that an answer reached its client whole wherever it was served."""

import json
import threading
import time

import httpx

from tokenflow.replicas.ingress import REPLICA_HEADER

KEY = "live-moves-key"
AUTH = {"authorization": f"Bearer {KEY}"}
# Greedy text is the same whatever a step's batch holds only on batch-invariant kernels: this
# CPU's default ones (bfloat16, 4-bit projections) pick a path by the number of rows, and an
# answer's token 15 already differed between a batch of two and a run alone; float32 does not.
REPLICA_ARGV = ["--num-threads", "1", "--dtype", "float32", "--api-key", KEY]


def greedy_answers(max_tokens: int) -> list[tuple[str, dict]]:
    """Two completions and two chats, greedy, exactly `max_tokens` long: (path, body)."""
    common = {"max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True}
    common |= {"temperature": 0, "stream": True, "stream_options": {"include_usage": True}}

    def chat(content: str) -> tuple[str, dict]:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": content}]}

    return [
        (path, {**body, **common})
        for path, body in [
            ("/v1/completions", {"prompt": "Once upon a time"}),
            ("/v1/completions", {"prompt": "The three largest cities of Europe are"}),
            chat("Write a short poem about the sea."),
            chat("How do plants make their food?"),
        ]
    ]


def read_answer(url: str, path: str, body: dict, rate: float, out: dict, first: threading.Event):
    """One streamed answer read to its end into `out`: its status and first replica once the
    response opens, then every event's data and when it came (time.monotonic)."""
    out.update(events=[], times_s=[])
    body = {**body, "stream_rate": rate}
    with httpx.stream("POST", url + path, json=body, headers=AUTH, timeout=600) as response:
        out["replica"] = response.headers.get(REPLICA_HEADER)
        out["status"] = response.status_code
        for line in response.iter_lines():
            if line.startswith("data: "):
                out["events"].append(line[6:])
                out["times_s"].append(time.monotonic())
                first.set()
    first.set()  # (also when it failed before any event: the test does not wait forever)


def read_all(
    url: str, answers: list[tuple[str, dict]], rate: float
) -> tuple[list[dict], list[threading.Event], list[threading.Thread]]:
    """Every answer read by a thread of its own, started now: (results, first events, threads)."""
    results: list[dict] = [{} for _ in answers]
    firsts = [threading.Event() for _ in answers]
    threads = [
        threading.Thread(target=read_answer, args=(url, path, body, rate, result, first))
        for (path, body), result, first in zip(answers, results, firsts, strict=True)
    ]
    for thread in threads:
        thread.start()
    return results, firsts, threads


def chunks_of(result: dict) -> list[dict]:
    return [json.loads(e) for e in result["events"] if e != "[DONE]"]


def text_of(result: dict) -> str:
    parts = []
    for chunk in chunks_of(result):
        for choice in chunk["choices"]:
            parts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(parts)


def check_whole(result: dict, max_tokens: int) -> None:
    """One answer, whole: one id, no error, one usage chunk over every token, one [DONE] last,
    and (chat) one role chunk."""
    chunks = chunks_of(result)
    assert result["status"] == 200 and not [c for c in chunks if "error" in c], result
    assert result["events"].count("[DONE]") == 1 and result["events"][-1] == "[DONE]"
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    usages = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usages) == 1 and usages[0]["completion_tokens"] == max_tokens
    if chunks[0]["object"] == "chat.completion.chunk":
        roles = [c for c in chunks for ch in c["choices"] if ch["delta"].get("role")]
        assert len(roles) == 1
