"""A deterministic `EngineClient` for server and benchmark tests (no model, no scheduler).

Tokenizer: whitespace words, one token each, ids assigned on first sight (per instance).
Output: token i of every request is the word `t{i}` (or `words[i]`, then EOS, where `words` is
given); each token takes `token_delay_s`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from tokenflow.core.request import Consumption, SamplingParams
from tokenflow.engine.client import (
    EngineDead,
    EngineHealth,
    EngineOverloaded,
    EngineRequestError,
    EngineStats,
    GenerationDelta,
)
from tokenflow.engine.snapshot import StreamRow, StreamsSnapshot

EOS = "<eos>"


class WordTokenizer:
    """Splits on whitespace; decodes each token as `" " + word`."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {EOS: 0}
        self._words: list[str] = [EOS]
        self.eos_token_id: int | None = 0

    max_token_chars = 64  # a word longer than this is never one token
    renders_tools = False  # its template has no tools section

    def token_id(self, word: str) -> int:
        if word not in self._ids:
            self._ids[word] = len(self._words)
            self._words.append(word)
        return self._ids[word]

    eos_token: str | None = EOS
    bos_token: str | None = None
    chat_template: str | None = "{% for m in messages %}{{ m.content }} {% endfor %}"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.token_id(word) for word in text.split()]

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(" " + self._words[i] for i in token_ids if i != self.eos_token_id)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, str]],
        tools: object = None,
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, object] | None = None,
    ) -> list[int]:
        """`<|role|> content` per message, then `<|assistant|>`; each template variable as a
        `<|name=value|>` word first; with `continue_final_message`, the last message's turn is
        left open: its role word becomes `<|role...|>`."""
        variables = [f"<|{k}={v}|>" for k, v in sorted((chat_template_kwargs or {}).items())]
        parts = [f"<|{m['role']}|> {m['content']}" for m in messages]
        if continue_final_message:
            parts[-1] = f"<|{messages[-1]['role']}...|> {messages[-1]['content']}"
        opener = ["<|assistant|>"] if add_generation_prompt else []
        return self.encode(" ".join([*variables, *parts, *opener]))


@dataclass
class FakeEngine:
    """Implements `EngineClient`.

    eos_after: the EOS token comes at this output position (None: never), unless ignore_eos or
        min_tokens says otherwise.
    tokens_per_delta: tokens batched into one delta.
    max_num_requests: in-flight cap; beyond it `generate()` raises EngineOverloaded.
    fail_after_tokens: raise RuntimeError mid-stream after this many tokens (None: never);
        with `dies_mid_way`, EngineDead instead (the loop stopped, e.g. a drain's timeout).
    reject_prompts_longer_than: raise EngineRequestError for longer prompts (None: never).
    gate: output token `gate_at_token` of every stream waits until a test thread sets it (None:
        no wait), so a test decides when the stream goes on instead of racing a delay.
    """

    model_name: str = "fake-model"
    max_model_len: int = 256
    vocab_size: int = 1 << 20
    default_rate_tps: float = 20.0
    kernels: str | None = None
    token_delay_s: float = 0.0
    first_token_delay_s: float = 0.0
    eos_after: int | None = None
    tokens_per_delta: int = 1
    max_num_requests: int | None = None
    retry_after_s: float = 1.5
    fail_after_tokens: int | None = None
    dies_mid_way: bool = False
    reject_prompts_longer_than: int | None = None
    gate: threading.Event | None = None
    gate_at_token: int = 0
    words: tuple[str, ...] = ()  # the answer's words, then EOS (empty: t0, t1, ...)
    tokenizer: WordTokenizer = field(default_factory=WordTokenizer)
    active_ids: list[str] = field(default_factory=list)
    aborted_ids: list[str] = field(default_factory=list)
    submitted: list[tuple[str, SamplingParams, float]] = field(default_factory=list)
    consumptions: list[Consumption] = field(default_factory=list)  # each generate()'s class
    session_keys: list[str | None] = field(default_factory=list)  # each generate()'s hint
    prompts: list[tuple[int, ...]] = field(default_factory=list)  # each generate()'s prompt
    num_finished: int = 0
    num_refused: int = 0  # generate() calls refused with EngineOverloaded
    death: str | None = None  # health() reports the loop dead, generate() raises EngineDead
    seconds_since_tick: float = 0.0
    num_snapshots: int = 0  # streams() calls
    num_compiles: int = 0  # compile_grammar() calls with a structured output
    compile_gate: threading.Event | None = None  # compile_grammar() waits for it
    grammar_error: str | None = None  # compile_grammar() refuses with this message

    async def compile_grammar(self, sampling_params: SamplingParams) -> None:
        if sampling_params.structured_output is None:
            return
        self.num_compiles += 1
        if self.compile_gate is not None:
            await _opened(self.compile_gate)
        if self.grammar_error is not None:
            raise EngineRequestError(self.grammar_error)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        rate_tps: float,
        consumption: Consumption = Consumption.READER,
        *,
        session_key: str | None = None,
    ) -> AsyncIterator[GenerationDelta]:
        if self.death is not None:
            raise EngineDead(self.death)
        if self.max_num_requests is not None and len(self.active_ids) >= self.max_num_requests:
            self.num_refused += 1
            raise EngineOverloaded("too many requests waiting", retry_after_s=self.retry_after_s)
        limit = self.reject_prompts_longer_than
        if limit is not None and len(prompt_token_ids) > limit:
            raise EngineRequestError(f"prompt longer than {limit} tokens")
        self.submitted.append((request_id, sampling_params, rate_tps))
        self.consumptions.append(consumption)
        self.session_keys.append(session_key)
        self.prompts.append(tuple(prompt_token_ids))
        self.active_ids.append(request_id)
        try:
            await asyncio.sleep(self.first_token_delay_s)
            async for delta in self._deltas(request_id, len(prompt_token_ids), sampling_params):
                if delta.finish_reason in ("stop", "length"):
                    self.num_finished += 1
                yield delta
        finally:
            self.active_ids.remove(request_id)

    async def _deltas(
        self, request_id: str, num_prompt: int, params: SamplingParams
    ) -> AsyncIterator[GenerationDelta]:
        stream = _TextStream(params.stop)
        token_ids: list[int] = []
        num_output = 0
        finish_reason: str | None = None
        while finish_reason is None:
            if request_id in self.aborted_ids:
                finish_reason = "abort"
                break
            if num_output and self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            if self.gate is not None and num_output == self.gate_at_token:
                await _opened(self.gate)
            if self.fail_after_tokens is not None and num_output >= self.fail_after_tokens:
                if self.dies_mid_way:
                    raise EngineDead("the engine loop stopped: fake drain timeout")
                raise RuntimeError("fake engine failure")
            token_id, finish_reason = self._next_token(num_output, params)
            num_output += 1
            token_ids.append(token_id)
            if token_id != self.tokenizer.eos_token_id and stream.push(
                self.tokenizer.decode([token_id])
            ):
                finish_reason = "stop"
            if finish_reason is None and len(token_ids) < self.tokens_per_delta:
                continue
            text = stream.flush() if finish_reason else stream.take()
            yield GenerationDelta(
                request_id, tuple(token_ids), text, num_prompt, num_output, finish_reason
            )
            token_ids = []
        if finish_reason == "abort":
            yield GenerationDelta(request_id, tuple(token_ids), "", num_prompt, num_output, "abort")

    def _next_token(self, position: int, params: SamplingParams) -> tuple[int, str | None]:
        """The token at output `position` and the finish reason it causes (if any)."""
        can_stop = not params.ignore_eos and position >= params.min_tokens
        if self.words and position >= len(self.words) and can_stop:
            return 0, "stop"
        if self.eos_after is not None and position >= self.eos_after and can_stop:
            return 0, "stop"
        word = self.words[position] if position < len(self.words) else f"t{position}"
        token_id = self.tokenizer.token_id(word)
        if token_id in params.stop_token_ids and position >= params.min_tokens:
            return token_id, "stop"
        return token_id, "length" if position + 1 >= params.max_tokens else None

    async def abort(self, request_id: str) -> None:
        self.aborted_ids.append(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=0,
            num_running=len(self.active_ids),
            num_preempted=0,
            device_kv_usage=0.25,
            host_kv_usage=0.5,
            num_preemptions_total=3,
            num_loads_total=2,
            num_recomputes_total=1,
            buffer_slack_s=tuple(1.5 for _ in self.active_ids),
            prefix_cache_queries_total=40,
            prefix_cache_hits_total=24,
            prefix_cache_host_hits_total=8,
            num_cached_device_blocks=3,
            num_cached_host_blocks=2,
        )

    def health(self) -> EngineHealth:
        return EngineHealth(self.death is None, self.seconds_since_tick, self.death)

    async def streams(self, limit: int) -> StreamsSnapshot:
        """Every active request as a running reader with 1.5 s of buffer, no token yet read."""
        if self.death is not None:
            raise EngineDead(self.death)
        self.num_snapshots += 1
        streams = tuple(_fake_stream(request_id) for request_id in self.active_ids[:limit])
        return StreamsSnapshot(
            taken_s=0.0,
            policy="fake",
            streams=streams,
            num_waiting=0,
            num_running=len(self.active_ids),
            num_loading=0,
            num_paused=0,
            capacity_tps=100.0,
            demand_tps=self.default_rate_tps * len(self.active_ids),
            asked_tps=self.default_rate_tps * len(self.active_ids),
            num_readers=len(self.active_ids),
            num_served_readers=len(self.active_ids),
            num_device_blocks_used=1,
            num_device_blocks=4,
            num_host_blocks_used=2,
            num_host_blocks=4,
            num_cached_device_blocks=3,
            num_cached_host_blocks=2,
            num_prefix_queried_tokens=40,
            num_prefix_hit_tokens=24,
            num_prefix_host_hit_tokens=8,
            num_preemptions_total=3,
            num_loads_total=2,
            num_recomputes_total=1,
            last_moves=None,
        )


def _fake_stream(request_id: str) -> StreamRow:
    return StreamRow(
        request_id=request_id,
        consumption=Consumption.READER,
        rate_tps=20.0,
        state="running",
        is_kv_on_host=False,
        num_output_tokens=0,
        num_consumed_tokens=0,
        buffered_s=1.5,
        slack_s=1.5,
        ttft_s=None,
        stalled_s=None,
        age_s=0.0,
        num_preemptions=0,
        wait_reason=None,
    )


async def _opened(gate: threading.Event, timeout_s: float = 120.0) -> None:
    """Wait until another thread sets `gate`; the timeout only turns a hang into an error."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not gate.is_set():
        if loop.time() > deadline:
            raise RuntimeError("the test never opened the gate")
        await asyncio.sleep(0.005)


class _TextStream:
    """Detokenized text with stop strings: holds back a possible stop prefix, cuts at a stop."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = tuple(s for s in stop if s)
        self._holdback = max((len(s) - 1 for s in self._stop), default=0)
        self._text = ""
        self._emitted = 0

    def push(self, text: str) -> bool:
        """Append text; True when a stop string appeared (the text is cut before it)."""
        self._text += text
        hits = [i for i in (self._text.find(s) for s in self._stop) if i >= 0]
        if hits:
            self._text = self._text[: min(hits)]
            return True
        return False

    def take(self) -> str:
        end = max(self._emitted, len(self._text) - self._holdback)
        out, self._emitted = self._text[self._emitted : end], end
        return out

    def flush(self) -> str:
        out, self._emitted = self._text[self._emitted :], len(self._text)
        return out
