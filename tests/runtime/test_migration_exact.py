"""A stream moved between real engines (tiny model, CPU) goes on exactly: exported mid-answer
from one engine and imported into another, greedy, seeded sampled and penalised streams produce
the tokens and the text of an undisturbed run, and the reader's clock carries over."""

import pytest

from tokenflow.core.request import RequestState, SamplingParams
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.engine.llm_engine import LLMEngine

PROMPT = "Once upon a time, in a land far away"
STREAMS = {
    "greedy": SamplingParams(max_tokens=36, temperature=0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=36, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True),
    "penalised": SamplingParams(
        max_tokens=36,
        temperature=0.8,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        ignore_eos=True,
    ),
    "greedy-penalised": SamplingParams(
        max_tokens=36, temperature=0, frequency_penalty=1.5, ignore_eos=True
    ),
}
NUM_BEFORE_MOVE = 14  # tokens each stream produces on the first engine


class StepClock:
    """Deterministic time: the test advances it 50 ms a step."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t


def _engine(model_dir: str, clock_s: float = 0.0, **kwargs) -> LLMEngine:
    engine = LLMEngine(EngineArgs(model=model_dir, device="cpu", max_model_len=256, **kwargs))
    engine.core.clock = StepClock(clock_s)
    return engine


def _step(engine: LLMEngine, tokens: dict, texts: dict) -> None:
    _, deltas = engine.step()
    engine.core.clock.t += 0.05
    engine.scheduler.kv.check_integrity()
    for d in deltas:
        assert d.finish_reason in (None, "length"), d.error
        tokens[d.request_id].extend(d.token_ids)
        texts[d.request_id] += d.text


def _add_all(engine: LLMEngine) -> tuple[dict, dict]:
    for request_id, params in STREAMS.items():
        engine.add_request(request_id, engine.tokenizer.encode(PROMPT), params, rate_tps=4.0)
    return {r: [] for r in STREAMS}, dict.fromkeys(STREAMS, "")


@pytest.fixture(scope="module")
def undisturbed(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    tokens, texts = _add_all(engine)
    while engine.has_work:
        _step(engine, tokens, texts)
    engine.close()
    return tokens, texts


@pytest.mark.parametrize("max_prefill_tokens", [4096, 8], ids=["whole", "chunked-recompute"])
def test_moved_streams_continue_with_the_tokens_and_text_of_an_undisturbed_run(
    tiny_model_dir, undisturbed, max_prefill_tokens
):
    source = _engine(tiny_model_dir)
    tokens, texts = _add_all(source)
    while min(len(t) for t in tokens.values()) < NUM_BEFORE_MOVE:
        _step(source, tokens, texts)
    moved_at = source.core.clock.now()
    slack = {r: source.scheduler.requests[r].slack_s(moved_at) for r in STREAMS}
    states = [source.export_stream(r) for r in STREAMS]
    assert not source.has_work
    source.step()  # the executor forgets the exported streams' state on the next plan
    assert len(source.executor.token_counts) == 0
    source.close()

    # Another engine, its clock 1,000 s off the first's, prefilling 8 tokens a step at most.
    target = _engine(tiny_model_dir, 1000.0, max_prefill_tokens=max_prefill_tokens)
    for state in states:
        target.import_stream(state)
    now = target.core.clock.now()
    for request_id in STREAMS:
        request = target.scheduler.requests[request_id]
        assert request.state is RequestState.PREEMPTED and request.num_computed_tokens == 0
        assert request.slack_s(now) == pytest.approx(slack[request_id])
    while target.has_work:
        _step(target, tokens, texts)
    target.close()
    assert target.scheduler.num_recomputes_total == len(STREAMS)
    expected_tokens, expected_texts = undisturbed
    assert tokens == expected_tokens
    assert texts == expected_texts
    assert len(set(expected_tokens["seeded"])) > 10  # it does sample


def test_an_unknown_stream_cannot_be_exported(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    with pytest.raises(ValueError, match="no such unfinished request"):
        engine.export_stream("nope")
    engine.close()
