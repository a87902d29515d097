"""One bad request never hurts another on the real engine (tiny model): a poison sampling row,
a failing detokenizer and a failing forward pass each end only their own requests, and the
innocent stream beside them produces exactly its solo greedy tokens."""

from types import SimpleNamespace

import pytest

from tokenflow.core.request import SamplingParams
from tokenflow.engine.build import context_length
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = LLMEngine(EngineArgs(model=tiny_model_dir, device="cpu", max_model_len=256))
    yield engine
    engine.close()


def run(engine: LLMEngine, requests: dict[str, SamplingParams], max_steps: int = 500):
    """Add every request, step until done; per request: (token ids, finish, error)."""
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    ends: dict[str, tuple[str | None, str | None]] = {}
    for rid, params in requests.items():
        engine.add_request(rid, engine.tokenizer.encode("Once upon a time"), params)
    for _ in range(max_steps):
        if not engine.has_work:
            break
        _, deltas = engine.step()
        for d in deltas:
            tokens[d.request_id].extend(d.token_ids)
            if d.finish_reason is not None:
                ends[d.request_id] = (d.finish_reason, d.error)
    assert not engine.has_work
    engine.scheduler.kv.check_integrity()
    assert (
        engine.scheduler.kv.num_free_device_blocks == engine.scheduler.kv.config.num_device_blocks
    )
    return tokens, ends


@pytest.fixture(scope="module")
def solo(engine):
    tokens, ends = run(engine, {"solo": GREEDY})
    assert ends["solo"] == ("length", None)
    return tokens["solo"]


def test_a_tiny_temperature_is_served_and_hurts_no_one(engine, solo):
    # 1e-40 passes SamplingParams (>= 0); the sampler must not divide the logits into inf/nan.
    tiny = SamplingParams(max_tokens=12, temperature=1e-40, ignore_eos=True)
    tokens, ends = run(engine, {"tiny": tiny, "innocent": GREEDY})
    assert ends["tiny"] == ("length", None) and len(tokens["tiny"]) == 12
    assert ends["innocent"] == ("length", None) and tokens["innocent"] == solo


def test_a_poison_sampling_row_fails_only_its_own_request(engine, solo, monkeypatch):
    original = engine.executor.sampler._sample_rows

    def sample_rows(logits, rows):
        if any(row.request_id == "poison" for row in rows):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return original(logits, rows)

    monkeypatch.setattr(engine.executor.sampler, "_sample_rows", sample_rows)
    poison = SamplingParams(max_tokens=12, temperature=1.0)  # a sampled row, not greedy
    tokens, ends = run(engine, {"poison": poison, "innocent": GREEDY})
    assert ends["poison"][0] == "error" and "sampling failed" in ends["poison"][1]
    assert ends["innocent"] == ("length", None)
    assert tokens["innocent"] == solo


def test_a_failing_detokenizer_fails_only_its_own_request(engine, solo, monkeypatch):
    original = engine.outputs._advance

    def advance(stream, output):
        if output.request_id == "bad-text":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return original(stream, output)

    monkeypatch.setattr(engine.outputs, "_advance", advance)
    tokens, ends = run(engine, {"bad-text": GREEDY, "innocent": GREEDY})
    assert ends["bad-text"][0] == "error" and "detokenization" in ends["bad-text"][1]
    assert ends["innocent"] == ("length", None) and tokens["innocent"] == solo


def test_a_failed_step_fails_only_its_plan_and_the_engine_goes_on(engine, solo, monkeypatch):
    original = engine.executor.execute
    calls = {"n": 0}

    def execute(plan):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device fault")
        return original(plan)

    monkeypatch.setattr(engine.executor, "execute", execute)
    engine.add_request("doomed", engine.tokenizer.encode("first"), GREEDY)
    _, deltas = engine.step()
    assert [(d.request_id, d.finish_reason) for d in deltas] == [("doomed", "error")]
    assert "device fault" in deltas[0].error
    tokens, ends = run(engine, {"innocent": GREEDY})
    assert ends["innocent"] == ("length", None) and tokens["innocent"] == solo


def test_long_prompts_are_prefilled_in_chunks_for_every_policy(tiny_model_dir):
    engine = LLMEngine(
        EngineArgs(
            model=tiny_model_dir, device="cpu", policy="fcfs", max_model_len=512, block_size=16
        )
    )
    try:
        # 250 ms target at 1 ms per token -> 250-token chunks
        engine.scheduler.estimator._prefill_token_s = 0.001
        engine.add_request("long", list(range(5, 405)), GREEDY)
        plans = []
        execute = engine.executor.execute
        engine.core.executor = SimpleNamespace(execute=lambda p: (plans.append(p), execute(p))[1])
        while engine.has_work:
            engine.scheduler.estimator._prefill_token_s = 0.001
            engine.step()
        sizes = [max(len(c.token_ids) for c in p.chunks) for p in plans if p.chunks]
        assert sizes[:2] == [250, 150] and len(sizes) == 2 + GREEDY.max_tokens - 1
    finally:
        engine.close()


def test_context_follows_the_device_pool():
    assert context_length(None, 8192, 4096) == 4096
    assert context_length(None, 2048, 4096) == 2048
    assert context_length(1000, 2048, 4096) == 1000
    with pytest.raises(ValueError, match="does not fit the device KV tier"):
        context_length(8192, 8192, 4096)
