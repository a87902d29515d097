"""The benchmark client plays conversations closed loop against the fake-engine server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import pytest

from tests.eval.test_conversation import chat_spec
from tests.serving.fake_engine import FakeEngine
from tests.serving.live_server import serve_in_thread
from tokenflow.cli.main import main
from tokenflow.engine.client import GenerationDelta
from tokenflow.eval.client import ClientConfig, chat_messages, run_workload, segment_text
from tokenflow.eval.conversation import Segment
from tokenflow.eval.metrics import consumption_times_s
from tokenflow.eval.workload import LengthDist, RateMix, WorkloadRequest, generate
from tokenflow.serving.app import build_app


@dataclass
class RecordingEngine(FakeEngine):
    """A fake engine that keeps each prompt's text (its whitespace words)."""

    prompts: list[str] = field(default_factory=list)

    async def generate(  # type: ignore[override]
        self, request_id: str, prompt_token_ids: Sequence[int], *args, **kwargs
    ) -> AsyncIterator[GenerationDelta]:
        self.prompts.append(self.tokenizer.decode(prompt_token_ids))
        async for delta in super().generate(request_id, prompt_token_ids, *args, **kwargs):
            yield delta


def small_chat() -> list[WorkloadRequest]:
    spec = chat_spec(
        num_sessions=3,
        request_rate=20.0,
        min_turns=2,
        max_turns=3,
        system_prompt=LengthDist(12, 0),
        user_message=LengthDist(5, 1, minimum=2),
        output=LengthDist(6, 2, minimum=2),
        rates=RateMix.parse("500"),
        think_mean_s=0.05,
    )
    return generate(spec)


def config(url: str, **kwargs: object) -> ClientConfig:
    return ClientConfig(url=url, show_progress=False, timeout_s=30.0, **kwargs)  # type: ignore[arg-type]


def test_segment_texts_are_words_one_per_token_and_answers_are_repeated() -> None:
    segment = Segment("system", "app", 9)
    assert segment_text(segment) == segment_text(Segment("system", "app", 9))
    assert len(segment_text(segment).split()) == 9
    turn = next(r for r in small_chat() if r.turn == 1)
    messages = chat_messages(turn, {f"{turn.session_id}/0": "the answer"})
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[2]["content"] == "the answer"
    assert messages[0]["content"] == segment_text(turn.segments[0])


def test_turns_are_sent_after_the_previous_answer_was_read_with_the_real_answers() -> None:
    requests = small_chat()
    engine = RecordingEngine(token_delay_s=0.002, max_model_len=1024)
    with serve_in_thread(build_app(engine)) as url:
        run = asyncio.run(run_workload(requests, config(url), name="fake"))
    assert run.num_failed == 0 and run.num_unsent == 0, run.errors
    traces = {t.request_id: t for t in run.traces}
    for request in requests:
        trace = traces[request.request_id]
        assert trace.num_output_tokens == request.num_output_tokens
        # The whitespace tokenizer counts each word, each message's role marker and the
        # generation opener: the history held every earlier answer at its full length.
        assert trace.num_prompt_tokens == request.num_prompt_tokens + len(request.segments) + 1
        if request.after_id is not None:
            previous = traces[request.after_id]
            read_end_s = consumption_times_s(previous.token_times_s, previous.rate_tps)[-1]
            assert trace.arrival_s >= read_end_s + request.think_s - 1e-3
    assert sorted(engine.session_keys) == sorted(str(r.session_id) for r in requests)
    later_prompts = [p for p in engine.prompts if p.count("<|assistant|>") > 1]
    assert len(later_prompts) == sum(1 for r in requests if r.turn > 0)
    # The fake engine answers "t0 t1 ...": the history repeats those words, not drawn ones.
    assert all("<|assistant|> t0 t1" in prompt for prompt in later_prompts)


def test_a_failed_turn_ends_its_session() -> None:
    requests = small_chat()
    engine = FakeEngine(max_model_len=1024, fail_after_tokens=1)
    with serve_in_thread(build_app(engine)) as url:
        run = asyncio.run(run_workload(requests, config(url), name="fake"))
    num_first_turns = sum(1 for r in requests if r.turn == 0)
    assert run.num_failed == num_first_turns and len(run.traces) == num_first_turns
    assert run.num_unsent == len(requests) - num_first_turns
    assert any("not sent" in line for line in run.errors)


def test_a_conversation_needs_the_chat_endpoint() -> None:
    with pytest.raises(ValueError, match="chat endpoint"):
        asyncio.run(
            run_workload(small_chat(), config("http://127.0.0.1:9", endpoint="completions"))
        )


def test_bench_runs_a_conversation_workload(tmp_path, capsys) -> None:
    engine = FakeEngine(max_model_len=1024)
    args = ["--workload", "conversation", "--num-sessions", "2", "--turns", "2:2",
            "--system-len", "8", "--user-len", "4", "--output-len", "4", "--rates", "500",
            "--think-s", "0.01", "--request-rate", "50", "--no-progress",
            "--timeout", "30"]  # fmt: skip
    with serve_in_thread(build_app(engine)) as url:
        assert main(["bench", "--url", url, *args]) == 0
    assert "4/4" in capsys.readouterr().out  # every request done
    assert len(engine.session_keys) == 4 and len(set(engine.session_keys)) == 2
