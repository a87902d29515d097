"""A stream moved between real engines (tiny model, CPU) goes on exactly: exported mid-answer
from one engine and imported into another, greedy, seeded sampled and penalised streams produce
the tokens and the text of an undisturbed run, and the reader's clock carries over; so does a
stream held to a grammar, with penalties and logprobs (its matcher rebuilt on the target)."""

import pytest

from tests.runtime.test_grammar_exact import PARAMS as GRAMMAR_PARAMS
from tests.runtime.test_grammar_exact import PROMPTS as GRAMMAR_PROMPTS
from tests.runtime.test_grammar_exact import record
from tests.runtime.test_preemption_exact_scores import same_scores
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


def _run_grammar(engine: LLMEngine, ids: list[str], seen: dict, until: int | None) -> None:
    """Step until every stream has `until` tokens (None: to its end), recording per request
    (tokens, their logprobs, [the prompt's logprobs]) in `seen`."""
    while engine.has_work and (until is None or min(len(seen[r][0]) for r in ids) < until):
        _, deltas = engine.step()
        engine.core.clock.t += 0.05
        record(seen, deltas)


def test_a_stream_held_to_a_grammar_moves_and_continues_exactly(tiny_model_dir):
    ids = [f"g{i}" for i in range(2)]

    def added(engine: LLMEngine) -> dict:
        for request_id, prompt in zip(ids, GRAMMAR_PROMPTS, strict=False):
            engine.add_request(request_id, engine.tokenizer.encode(prompt), GRAMMAR_PARAMS, 4.0)
        return {r: ([], [], []) for r in ids}

    alone = _engine(tiny_model_dir)
    undisturbed = added(alone)
    _run_grammar(alone, ids, undisturbed, None)
    alone.close()

    source = _engine(tiny_model_dir)
    seen = added(source)
    _run_grammar(source, ids, seen, NUM_BEFORE_MOVE)
    states = [source.export_stream(r) for r in ids]
    source.step()  # the executor forgets the exported streams' matchers on the next plan
    assert source.grammars.num_matchers == 0
    source.close()
    target = _engine(tiny_model_dir, 1000.0)
    for state in states:
        target.import_stream(state)
    _run_grammar(target, ids, seen, None)
    target.step()  # (and the finished ones' on the next)
    assert target.grammars.num_matchers == 0
    target.close()
    assert all(len(seen[r][0]) > NUM_BEFORE_MOVE for r in ids)  # it moved mid-answer
    assert same_scores(seen, undisturbed)
    for request_id in ids:  # the grammar still held: a JSON object of the schema's keys
        assert alone.tokenizer.decode(seen[request_id][0]).startswith('{"name": "')


def test_an_unknown_stream_cannot_be_exported(tiny_model_dir):
    engine = _engine(tiny_model_dir)
    with pytest.raises(ValueError, match="no such unfinished request"):
        engine.export_stream("nope")
    engine.close()
