"""Penalties, min_p and logprobs on hand-built logits and chunks."""

import math

import torch

from tokenflow.core.plan import ScheduledChunk
from tokenflow.core.request import SamplingParams
from tokenflow.model.logprobs import PromptLogprobs, sampled_logprobs
from tokenflow.model.penalties import TokenCounts, apply_penalties
from tokenflow.model.sampler import Sampler, SamplingRow, drop_below_min_p


def chunk(tokens, start, num_output, samples, params) -> ScheduledChunk:
    return ScheduledChunk(
        request_id="r",
        token_ids=tuple(tokens),
        start_position=start,
        new_block_ids=(),
        block_table_start=0,
        samples_token=samples,
        sampling_params=params,
        num_output_tokens=num_output,
    )


def test_counts_come_from_the_chunks_and_survive_a_recompute() -> None:
    params = SamplingParams(max_tokens=8, frequency_penalty=1.0)
    counts = TokenCounts(vocab_size=6, device="cpu")
    counts.observe([chunk([1, 2], 0, 0, True, params)])  # the prompt; samples token 3
    counts.observe([chunk([3], 2, 1, True, params)])  # decode of 3; samples 3 again
    counts.observe([chunk([3], 3, 2, True, params)])
    before = counts.get("r").output_counts.clone()
    assert before.tolist() == [0, 0, 0, 2, 0, 0]
    counts.observe([chunk([1, 2, 3, 3], 0, 2, True, params)])  # a recompute sends all again
    assert torch.equal(counts.get("r").output_counts, before)
    assert counts.get("r").in_prompt.tolist() == [False, True, True, False, False, False]


def test_an_arrived_stream_s_chunked_recompute_counts_as_if_it_had_stayed() -> None:
    """A stream moved here mid-answer (prompt [1, 2, 4], outputs [3, 3, 5]) is recomputed in
    chunks; the first ones cannot tell prompt from output, so they wait for the sampling one."""
    params = SamplingParams(max_tokens=8, presence_penalty=1.0)
    stayed = TokenCounts(vocab_size=6, device="cpu")
    stayed.observe([chunk([1, 2, 4], 0, 0, True, params)])
    for position, token in enumerate([3, 3, 5]):
        stayed.observe([chunk([token], 3 + position, position + 1, True, params)])
    arrived = TokenCounts(vocab_size=6, device="cpu")
    arrived.observe([chunk([1, 2], 0, 3, False, params)])
    arrived.observe([chunk([4, 3], 2, 3, False, params)])
    assert arrived.get("r").output_counts.sum() == 0  # held until the prompt's end is known
    arrived.observe([chunk([3, 5], 4, 3, True, params)])
    assert torch.equal(arrived.get("r").output_counts, stayed.get("r").output_counts)
    assert torch.equal(arrived.get("r").in_prompt, stayed.get("r").in_prompt)
    assert arrived.get("r").output_counts.tolist() == [0, 0, 0, 2, 0, 1]


def test_penalties_as_vllm_defines_them() -> None:
    params = SamplingParams(
        max_tokens=8, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0
    )
    counts = TokenCounts(vocab_size=4, device="cpu")
    counts.observe([chunk([0], 0, 0, True, params), chunk([2, 2], 1, 2, True, params)])
    seen = counts.get("r")
    logits = torch.tensor([[2.0, 1.0, -1.0, 3.0]])
    out = apply_penalties(logits, [params], [seen])
    # token 0: in the prompt only -> 2 / 2; token 2: twice in the output -> -1 * 2 - 0.5 - 0.5
    assert out.tolist() == [[1.0, 1.0, -3.0, 3.0]]
    assert apply_penalties(logits, [params], [None]) is logits  # no row asks: untouched


def test_min_p_drops_the_unlikely() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert (drop_below_min_p(probs, [0.4]) > 0).tolist() == [[True, True, False, False]]
    assert drop_below_min_p(probs, [0.0]) is probs


def test_greedy_follows_the_penalised_logits() -> None:
    params = SamplingParams(max_tokens=8, temperature=0, presence_penalty=2.0)
    counts = TokenCounts(vocab_size=3, device="cpu")
    counts.observe([chunk([0, 1], 0, 1, True, params)])  # prompt [0], output [1]
    logits = torch.tensor([[0.0, 1.0, 0.5]])
    row = SamplingRow("r", params, 1, counts.get("r"))
    assert Sampler(eos_token_ids=()).sample(logits, [row]) == [2]


def test_min_tokens_bans_eos_until_reached() -> None:
    params = SamplingParams(max_tokens=8, temperature=0, min_tokens=2)
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    sampler = Sampler(eos_token_ids=(0,))
    assert sampler.sample(logits, [SamplingRow("r", params, 1)]) == [1]
    assert sampler.sample(logits, [SamplingRow("r", params, 2)]) == [0]


def test_sampled_logprobs_only_for_rows_that_ask() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    plain, asking = SamplingParams(), SamplingParams(logprobs=2)
    out = sampled_logprobs(logits, [plain, asking], [2, 1])
    assert out[0] is None
    entry = out[1]
    expected = torch.log_softmax(logits[1], dim=-1)
    assert entry.token_id == 1 and math.isclose(entry.logprob, expected[1].item())
    assert entry.top_token_ids[0] == 0 and len(entry.top_token_ids) == 2


def test_prompt_logprobs_across_chunks_match_one_chunk() -> None:
    params = SamplingParams(max_tokens=4, prompt_logprobs=1)
    torch.manual_seed(0)
    logits = torch.randn(4, 5)  # row p scores the token at p + 1
    tokens = [1, 3, 0, 4]
    whole = PromptLogprobs()
    whole.record(chunk(tokens, 0, 0, True, params), logits[:3])
    split = PromptLogprobs()
    split.record(chunk(tokens[:2], 0, 0, False, params), logits[:2])
    split.record(chunk(tokens[2:], 2, 0, True, params), logits[2:3])
    want = whole.take("r")
    assert want[0] is None and len(want) == 4
    assert split.take("r") == want
    assert want[1].token_id == 3
    assert math.isclose(want[1].logprob, torch.log_softmax(logits[0], -1)[3].item())
