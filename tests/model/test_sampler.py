"""Sampling: greedy, seeded reproducibility, top-k / top-p, min_tokens masking."""

from __future__ import annotations

import torch

from tokenflow.core.request import SamplingParams
from tokenflow.model import Sampler, SamplingRow
from tokenflow.model.sampler import position_uniform

VOCAB = 50
EOS = 7


def _logits(num_rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _draw(sampler: Sampler, request_id: str, params: SamplingParams, steps: int) -> list[int]:
    return [
        sampler.sample(_logits(seed=step), [SamplingRow(request_id, params, step)])[0]
        for step in range(steps)
    ]


def test_greedy_is_argmax_for_the_whole_batch():
    logits = _logits(4)
    rows = [SamplingRow(f"r{i}", SamplingParams(temperature=0.0), 0) for i in range(4)]
    assert Sampler([EOS]).sample(logits, rows) == logits.argmax(-1).tolist()


def test_seeded_requests_reproduce_their_stream():
    params = SamplingParams(temperature=1.0, seed=1234)
    first = _draw(Sampler([EOS], seed=0), "a", params, 20)
    second = _draw(Sampler([EOS], seed=99), "other-id", params, 20)  # seed decides, not ids
    assert first == second
    assert len(set(first)) > 3  # it does sample


def test_seeded_stream_does_not_depend_on_batch_neighbours():
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    alone = _draw(Sampler([EOS]), "a", params, 10)
    sampler = Sampler([EOS])
    crowded = []
    for step in range(10):
        logits = torch.cat([_logits(seed=100 + step), _logits(seed=step)])
        rows = [
            SamplingRow("noise", SamplingParams(temperature=1.0), step),
            SamplingRow("a", params, step),
        ]
        crowded.append(sampler.sample(logits, rows)[1])
    assert crowded == alone


def test_unseeded_requests_are_deterministic_per_engine_seed_and_id():
    params = SamplingParams(temperature=1.0)
    assert _draw(Sampler([EOS], 5), "x", params, 10) == _draw(Sampler([EOS], 5), "x", params, 10)
    assert _draw(Sampler([EOS], 5), "x", params, 10) != _draw(Sampler([EOS], 5), "y", params, 10)


def test_top_k_one_and_tiny_top_p_equal_greedy():
    logits = _logits(3)
    greedy = logits.argmax(-1).tolist()
    for params in (
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.5, top_p=1e-6),
    ):
        rows = [SamplingRow(f"r{i}", params, 0) for i in range(3)]
        assert Sampler([EOS]).sample(logits, rows) == greedy


def test_top_k_only_draws_from_the_k_best():
    logits = _logits()
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    sampler = Sampler([EOS])
    params = SamplingParams(temperature=2.0, top_k=3, seed=3)
    draws = {sampler.sample(logits, [SamplingRow("a", params, i)])[0] for i in range(50)}
    assert draws <= allowed and len(draws) > 1


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 100.0
    logits[0, 9] = 90.0
    params = SamplingParams(max_tokens=10, temperature=0.0, min_tokens=3, stop_token_ids=(9,))
    sampler = Sampler([EOS])
    assert sampler.sample(logits, [SamplingRow("a", params, 2)]) != [EOS]
    assert sampler.sample(logits, [SamplingRow("a", params, 2)]) != [9]
    assert sampler.sample(logits, [SamplingRow("a", params, 3)]) == [EOS]


def test_a_stream_resumed_by_a_fresh_sampler_draws_what_it_would_have():
    """Draws are keyed by (seed, position): a seeded stream moved mid-answer to another engine
    (a new sampler, another engine seed) goes on with the tokens of the undisturbed run."""
    params = SamplingParams(temperature=1.0, seed=11)
    undisturbed = _draw(Sampler([EOS], seed=0), "a", params, 12)
    elsewhere = Sampler([EOS], seed=3)
    resumed = [
        elsewhere.sample(_logits(seed=step), [SamplingRow("a", params, step)])[0]
        for step in range(7, 12)
    ]
    assert resumed == undisturbed[7:]


def test_position_uniforms_are_independent_per_position_and_stream():
    draws = [position_uniform("seed:1", p) for p in range(2000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.02  # mean of 2000 uniforms: sd 0.0065
    assert len(set(draws)) == len(draws)
    assert position_uniform("seed:1", 5) != position_uniform("seed:2", 5)
    assert position_uniform("seed:1", 5) == position_uniform("seed:1", 5)


def test_batched_draws_follow_the_distribution():
    # 4000 rows of the same logits, one draw each from 4000 seeds: frequencies match softmax.
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]]).repeat(4000, 1)
    rows = [SamplingRow(f"r{i}", SamplingParams(temperature=1.0, seed=i), 0) for i in range(4000)]
    tokens = torch.tensor(Sampler([EOS]).sample(logits, rows))
    counts = torch.bincount(tokens, minlength=5).double() / 4000
    expected = torch.softmax(logits[0], dim=-1).double()
    assert counts[4] == 0  # a zero-probability token is never drawn
    assert torch.allclose(counts, expected, atol=0.03), (counts, expected)


def test_temperature_sharpens_the_batched_distribution():
    logits = torch.tensor([[1.0, 0.0]]).repeat(2000, 1)
    cold = [SamplingRow(f"c{i}", SamplingParams(temperature=0.25, seed=i), 0) for i in range(2000)]
    hot = [SamplingRow(f"h{i}", SamplingParams(temperature=4.0, seed=i), 0) for i in range(2000)]
    tokens = Sampler([EOS]).sample(torch.cat([logits, logits]), cold + hot)
    cold_zero = tokens[:2000].count(0) / 2000  # expected 1 / (1 + e^-4) = 0.982
    hot_zero = tokens[2000:].count(0) / 2000  # expected 1 / (1 + e^-0.25) = 0.562
    assert abs(cold_zero - 0.982) < 0.02 and abs(hot_zero - 0.562) < 0.05


def test_mixed_batch_applies_each_rows_own_top_k_and_top_p():
    logits = _logits(4, seed=5)
    params = [
        SamplingParams(temperature=1.0, top_k=2, seed=1),
        SamplingParams(temperature=1.0, top_p=0.5, seed=2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=3, top_p=0.3, seed=3),
    ]
    sampler = Sampler([EOS])
    allowed = [
        set(torch.topk(logits[0], 2).indices.tolist()),
        _nucleus(logits[1], 0.5),
        {int(logits[2].argmax())},
        _nucleus(logits[3].masked_fill(logits[3] < torch.topk(logits[3], 3).values[-1], -1e9), 0.3),
    ]
    seen: list[set[int]] = [set() for _ in params]
    for step in range(60):
        rows = [SamplingRow(f"r{i}", p, step) for i, p in enumerate(params)]
        for i, token in enumerate(sampler.sample(logits, rows)):
            seen[i].add(token)
    for i in range(4):
        assert seen[i] <= allowed[i], (i, seen[i], allowed[i])
    assert len(seen[0]) == 2  # both of the two best were drawn


def _nucleus(row: torch.Tensor, top_p: float) -> set[int]:
    """The smallest set of most likely tokens whose mass reaches top_p (reference)."""
    probs, order = torch.sort(torch.softmax(row, dim=-1), descending=True)
    kept, mass = set(), 0.0
    for p, token in zip(probs.tolist(), order.tolist(), strict=True):
        kept.add(token)
        mass += p
        if mass >= top_p:
            break
    return kept
