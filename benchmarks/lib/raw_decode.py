"""Raw decode throughput of an OpenAI server: N streams of a fixed length sent together, no
reading-rate pacing. Throughput of a round = generated tokens (from `usage`) / wall time from
the first send to the last token; TPOT = (last token - first token) / (tokens - 1), averaged over
the streams."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import httpx

# ~32 SmolLM2 tokens; each stream prepends its index so a prefix cache cannot skip prefill.
PROMPT = (
    "Write a long, detailed story about a lighthouse keeper who finds a strange glowing map "
    "washed up on the rocks one stormy winter night, and what happens when"
)
WARM_UP_TOKENS = 16


class DecodeError(RuntimeError):
    """A request of a round failed (the server's answer is in the message)."""


@dataclass(frozen=True)
class StreamResult:
    num_tokens: int  # completion_tokens from the final usage chunk
    first_token_s: float  # perf_counter() at the first chunk with text (else the last chunk)
    last_token_s: float  # perf_counter() at the last chunk: a token whose text is empty may
    # send none, so its time is the next chunk's (the usage chunk for the last ones)


@dataclass(frozen=True)
class RoundResult:
    concurrency: int
    num_tokens: int
    wall_s: float  # first send -> last token of the round
    mean_tpot_ms: float

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s


@dataclass(frozen=True)
class Row:
    """One concurrency: the other server's best variant (e.g. vLLM's faster dtype) and ours."""

    concurrency: int
    theirs: RoundResult
    theirs_variant: str
    ours: RoundResult

    @property
    def ratio(self) -> float:
        return self.ours.tokens_per_s / self.theirs.tokens_per_s


def request_body(model_id: str, index: int, max_tokens: int) -> dict[str, object]:
    """Stream `index`'s request: exactly `max_tokens` tokens, greedy, usage at the end."""
    return {
        "model": model_id,
        "prompt": f"[{index}] {PROMPT}",
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_one(client: httpx.AsyncClient, body: dict[str, object]) -> StreamResult:
    """One streaming completion; token count from the final `usage` chunk."""
    first_s = last_s = 0.0
    num_tokens = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")[:300]
            raise DecodeError(f"/v1/completions answered {response.status_code}: {text}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            last_s = time.perf_counter()  # (tokens whose text is empty may send no chunk)
            if any(choice.get("text") for choice in chunk.get("choices") or []):
                first_s = first_s or last_s
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    if num_tokens is None:
        raise DecodeError("a stream ended without a usage chunk")
    return StreamResult(num_tokens, first_s or last_s, last_s)


async def run_round(url: str, model_id: str, concurrency: int, max_tokens: int) -> RoundResult:
    """`concurrency` streams sent together; wall time from the first send to the last token."""
    limits = httpx.Limits(max_connections=concurrency + 1)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        bodies = [request_body(model_id, i, max_tokens) for i in range(concurrency)]
        start_s = time.perf_counter()
        streams = await asyncio.gather(*(stream_one(client, body) for body in bodies))
    tpots_ms = [
        1000 * (s.last_token_s - s.first_token_s) / (s.num_tokens - 1)
        for s in streams
        if s.num_tokens > 1
    ]
    return RoundResult(
        concurrency=concurrency,
        num_tokens=sum(s.num_tokens for s in streams),
        wall_s=max(s.last_token_s for s in streams) - start_s,
        mean_tpot_ms=sum(tpots_ms) / len(tpots_ms) if tpots_ms else float("nan"),
    )


def measure(
    name: str, url: str, model_id: str, concurrencies: Sequence[int], max_tokens: int, repeats: int
) -> list[RoundResult]:
    """A warm-up request, then the best of `repeats` rounds per concurrency (other work on a
    shared CPU only ever slows a round down); prints a line per concurrency."""
    try:
        asyncio.run(run_round(url, model_id, 1, min(WARM_UP_TOKENS, max_tokens)))
    except httpx.HTTPError as error:
        raise DecodeError(f"{name}: warm-up request failed: {error!r}") from None
    results = []
    for concurrency in concurrencies:
        try:
            rounds = [
                asyncio.run(run_round(url, model_id, concurrency, max_tokens))
                for _ in range(repeats)
            ]
        except httpx.HTTPError as error:
            raise DecodeError(f"{name}: round of {concurrency} failed: {error!r}") from None
        result = max(rounds, key=lambda r: r.tokens_per_s)
        print(
            f"{name}: {concurrency:>3} streams  {result.tokens_per_s:8.1f} tok/s  "
            f"TPOT {result.mean_tpot_ms:7.1f} ms  ({result.num_tokens} tokens, "
            f"{result.wall_s:.1f} s)",
            flush=True,
        )
        results.append(result)
    return results


def best_rows(theirs: Mapping[str, list[RoundResult]], ours: list[RoundResult]) -> list[Row]:
    """Per concurrency: the other server's fastest variant against ours."""
    rows = []
    for index, mine in enumerate(ours):
        variant, best = max(
            ((v, r[index]) for v, r in theirs.items()), key=lambda item: item[1].tokens_per_s
        )
        rows.append(Row(mine.concurrency, best, variant, mine))
    return rows


def format_rows(rows: list[Row], theirs: Mapping[str, list[RoundResult]], label: str) -> str:
    """The table: every variant's tok/s, ours, ours / best, and both TPOTs."""
    per_variant = "".join(f" {label + ' ' + v[:4]:>11}" for v in theirs)
    lines = [
        f"{'streams':>7}{per_variant} {'ours tok/s':>11} {'ours/best':>10} "
        f"{label + ' TPOT ms':>13} {'ours TPOT ms':>13}"
    ]
    for index, row in enumerate(rows):
        cells = "".join(f" {r[index].tokens_per_s:>11.1f}" for r in theirs.values())
        lines.append(
            f"{row.concurrency:>7}{cells} {row.ours.tokens_per_s:>11.1f} "
            f"{row.ratio:>9.2f}x {row.theirs.mean_tpot_ms:>13.1f} {row.ours.mean_tpot_ms:>13.1f}"
        )
    return "\n".join(lines)


def row_records(rows: list[Row], theirs: Mapping[str, list[RoundResult]]) -> list[dict]:
    """JSON-able rows: concurrency, the best variant, every variant's tok/s, ours, the ratio."""
    return [
        {
            "concurrency": row.concurrency,
            "vllm_dtype": row.theirs_variant,
            "vllm_tps": row.theirs.tokens_per_s,
            **{f"vllm_{v}_tps": r[i].tokens_per_s for v, r in theirs.items()},
            "ours_tps": row.ours.tokens_per_s,
            "ratio": row.ratio,
        }
        for i, row in enumerate(rows)
    ]
