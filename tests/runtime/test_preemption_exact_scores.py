"""Penalties and logprobs survive preemption exactly: greedy streams with presence, frequency and
repetition penalties, asking for logprobs (and the prompt's), give the same tokens, the same
alternatives and the same logprobs when offloaded and reloaded, or dropped and recomputed, as
when run alone.  The logprobs' values are compared to float32 rounding (1e-4): a batch of another
shape sums the same products in another order, which moves a float32 logit by an ulp or so."""

import math

from tests.runtime.test_preemption_exact import DTYPE, PROMPTS, StepClock
from tokenflow.core.request import SamplingParams
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.engine.llm_engine import LLMEngine

PARAMS = SamplingParams(
    max_tokens=40,
    temperature=0,
    ignore_eos=True,
    presence_penalty=0.5,
    frequency_penalty=0.3,
    repetition_penalty=1.3,
    logprobs=3,
    prompt_logprobs=2,
)


def run(engine: LLMEngine, rate_tps: float | None) -> dict[str, tuple]:
    clock = StepClock()
    engine.core.clock = clock
    seen: dict[str, tuple[list, list, list]] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", engine.tokenizer.encode(prompt), PARAMS, rate_tps)
        seen[f"r{i}"] = ([], [], [])
    steps = 0
    while engine.has_work:
        _, deltas = engine.step()
        clock.t += 0.05
        for d in deltas:
            tokens, logprobs, prompt = seen[d.request_id]
            tokens.extend(d.token_ids)
            logprobs.extend(d.logprobs)
            if d.prompt_logprobs is not None:
                prompt.append(d.prompt_logprobs)
        steps += 1
        assert steps < 20_000
    return {k: (t, lp, p) for k, (t, lp, p) in seen.items()}


def same_scores(got: dict[str, tuple], want: dict[str, tuple]) -> bool:
    """Same tokens and alternatives; logprobs equal to float32 rounding."""
    assert got.keys() == want.keys()
    for key in want:
        (tokens, logprobs, prompt), (want_tokens, want_logprobs, want_prompt) = got[key], want[key]
        assert tokens == want_tokens, key
        assert len(prompt) == len(want_prompt) == 1
        entries = list(logprobs) + list(prompt[0])
        want_entries = list(want_logprobs) + list(want_prompt[0])
        assert len(entries) == len(want_entries)
        for entry, want_entry in zip(entries, want_entries, strict=True):
            if want_entry is None:
                assert entry is None
                continue
            assert (entry.token_id, entry.top_token_ids) == (
                want_entry.token_id,
                want_entry.top_token_ids,
            ), key
            values = (entry.logprob, *entry.top_logprobs)
            want_values = (want_entry.logprob, *want_entry.top_logprobs)
            assert all(
                math.isclose(a, b, abs_tol=1e-4) for a, b in zip(values, want_values, strict=True)
            ), key
    return True


def args(model_dir: str, **kv) -> EngineArgs:
    return EngineArgs(model=model_dir, device="cpu", dtype=DTYPE["cpu"], **kv)


def test_penalised_scored_streams_are_exact_across_reload_and_recompute(tiny_model_dir):
    alone = run(LLMEngine(args(tiny_model_dir, policy="fcfs", max_num_seqs=1)), None)
    assert len(alone) == len(PROMPTS)
    for tokens, logprobs, prompt in alone.values():
        assert len(tokens) == len(logprobs) == 40
        assert len(prompt) == 1 and prompt[0][0] is None  # the first prompt token: unscored
        assert all(len(entry.top_token_ids) == 3 for entry in logprobs)
    reloaded = LLMEngine(
        args(
            tiny_model_dir,
            policy="tokenflow",
            block_size=8,
            device_kv_tokens=96,
            host_kv_tokens=4096,
        )
    )
    assert same_scores(run(reloaded, 2.0), alone)
    assert reloaded.scheduler.num_loads_total >= 4
    recomputed = LLMEngine(
        args(tiny_model_dir, policy="fcfs", block_size=8, device_kv_tokens=96, host_kv_tokens=0)
    )
    recomputed.scheduler.new_token_ratio = 0.0  # admit optimistically so decode growth hits OOM
    assert same_scores(run(recomputed, 2.0), alone)
    assert recomputed.scheduler.num_recomputes_total >= 1


def test_penalties_change_the_answer(tiny_model_dir):
    engine = LLMEngine(args(tiny_model_dir, policy="fcfs"))
    prompt = engine.tokenizer.encode(PROMPTS[0])
    plain = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outputs = []
    for params in (plain, PARAMS):
        engine.add_request(f"p{len(outputs)}", prompt, params)
        tokens = []
        while engine.has_work:
            tokens.extend(t for d in engine.step()[1] for t in d.token_ids)
        outputs.append(tokens)
    assert outputs[0] != outputs[1]
    assert len(set(outputs[1])) >= len(set(outputs[0]))  # penalised: fewer repeats
