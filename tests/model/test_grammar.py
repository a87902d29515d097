"""Grammar masks on hand-built logits: a forbidden token is never sampled, rows without a
grammar are untouched, EOS only where the value is complete, bad schemas name the problem."""

from __future__ import annotations

import json

import pytest
import torch

from tokenflow.core.request import SamplingParams, StructuredOutput
from tokenflow.model import Sampler, SamplingRow
from tokenflow.model.grammar import GrammarError, Grammars, unpack_bitmask
from tokenflow.model.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir) -> Tokenizer:
    tokenizer = Tokenizer.from_directory(tiny_model_dir)
    assert tokenizer is not None
    return tokenizer


@pytest.fixture
def grammars(tokenizer) -> Grammars:
    grammars = Grammars(tokenizer, tokenizer.vocab_size, [EOS])
    yield grammars
    grammars.close()  # its compile process


def _constrained(schema: dict, temperature: float = 0.0, seed: int | None = None) -> SamplingParams:
    spec = StructuredOutput(json.dumps(schema))
    return SamplingParams(max_tokens=64, temperature=temperature, seed=seed, structured_output=spec)


def test_unpack_bitmask_reads_bit_j_of_word_w_as_token_32w_plus_j():
    bitmask = torch.tensor([[0b101, 1 << 20], [0, -1]], dtype=torch.int32)  # [2 rows, 2 words]
    allowed = unpack_bitmask(bitmask, 60)
    assert allowed.shape == (2, 60)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, 52]
    assert allowed[1].nonzero().flatten().tolist() == list(range(32, 60))


def test_a_forbidden_favourite_is_never_sampled_and_free_rows_are_untouched(grammars, tokenizer):
    vocab = tokenizer.vocab_size
    favourite = tokenizer.encode("hello")[0]
    logits = torch.zeros(2, vocab)
    logits[:, favourite] = 50.0  # what both rows would pick freely
    logits[:, EOS] = 40.0
    params = [_constrained(SCHEMA), SamplingParams(temperature=0.0)]
    before = logits[1].clone()
    grammars.mask(logits, ["json", "free"], params)
    assert torch.equal(logits[1], before)  # no grammar: the row is exactly as it was
    assert logits[0, favourite] == float("-inf") and logits[0, EOS] == float("-inf")
    assert torch.isfinite(logits[0]).sum() > 0
    rows = [SamplingRow("json", params[0], 0), SamplingRow("free", params[1], 0)]
    token_ids = Sampler([EOS]).sample(logits, rows)
    assert token_ids[1] == favourite
    assert tokenizer.decode([token_ids[0]]).startswith("{")


def test_sampled_streams_under_noise_are_always_valid_json_of_the_schema(grammars, tokenizer):
    # Random logits that push EOS and a few JSON-breaking tokens: every token is allowed, and
    # EOS comes only once the object is whole (the schema's maxLength bounds the string).
    breaking = tokenizer.encode(" }]") + [EOS]
    sampler = Sampler([EOS], seed=3)
    for stream in range(4):
        params = _constrained(SCHEMA, temperature=1.0, seed=stream)
        request_id, output = f"s{stream}", []
        for step in range(64):
            logits = torch.randn(
                1, tokenizer.vocab_size, generator=torch.Generator().manual_seed(step)
            )
            logits[0, breaking] += 8.0
            grammars.mask(logits, [request_id], [params])
            token_ids = sampler.sample(logits, [SamplingRow(request_id, params, step)])
            failed: dict[str, str] = {}
            grammars.accept([request_id], token_ids, failed)
            assert failed == {}
            if token_ids[0] == EOS:
                break
            output.extend(token_ids)
        else:
            pytest.fail(f"stream {stream} did not end within 64 tokens")
        value = json.loads(tokenizer.decode(output))
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_a_released_matcher_starts_over(grammars, tokenizer):
    params = _constrained(SCHEMA)
    logits = torch.zeros(1, tokenizer.vocab_size)
    grammars.mask(logits, ["r"], [params])
    token = int(logits.argmax())
    grammars.accept(["r"], [token], {})
    grammars.release(["r"])
    assert grammars.num_matchers == 0
    again = torch.zeros(1, tokenizer.vocab_size)
    grammars.mask(again, ["r"], [params])
    assert torch.equal(torch.isfinite(again), torch.isfinite(logits))  # the first token's mask


def test_a_resumed_matcher_masks_as_the_one_that_accepted_the_same_tokens(grammars, tokenizer):
    params = _constrained(SCHEMA)
    generated = []
    for _ in range(5):  # the source: five greedy tokens under the grammar
        logits = torch.zeros(1, tokenizer.vocab_size)
        grammars.mask(logits, ["source"], [params])
        generated.append(int(logits.argmax()))
        grammars.accept(["source"], generated[-1:], {})
    source_mask = torch.zeros(1, tokenizer.vocab_size)
    grammars.mask(source_mask, ["source"], [params])
    first_mask = torch.zeros(1, tokenizer.vocab_size)
    grammars.mask(first_mask, ["fresh"], [params])

    grammars.resume("moved", params, generated)
    moved_mask = torch.zeros(1, tokenizer.vocab_size)
    grammars.mask(moved_mask, ["moved"], [params])
    assert torch.equal(torch.isfinite(moved_mask), torch.isfinite(source_mask))
    assert not torch.equal(torch.isfinite(moved_mask), torch.isfinite(first_mask))


def test_resuming_with_a_token_the_grammar_refuses_names_it(grammars, tokenizer):
    hello = tokenizer.encode("hello")[0]
    with pytest.raises(ValueError, match=f"does not allow token {hello} at position 0"):
        grammars.resume("moved", _constrained(SCHEMA), [hello])
    assert grammars.num_matchers == 0


def test_a_token_the_grammar_refuses_fails_only_its_request(grammars, tokenizer):
    params = _constrained(SCHEMA)
    grammars.mask(torch.zeros(2, tokenizer.vocab_size), ["a", "b"], [params, params])
    failed: dict[str, str] = {}
    brace = tokenizer.encode("{")[0]
    grammars.accept(["a", "b"], [tokenizer.encode("hello")[0], brace], failed)
    assert list(failed) == ["a"] and "does not allow" in failed["a"]


@pytest.mark.parametrize(
    ("schema", "problem"),
    [
        ('{"type": "bogus"}', "bogus"),
        ('{"properties": {"a": {"$ref": "#/nowhere"}}}', "nowhere"),
        ("{not json", "cannot be compiled"),
    ],
)
def test_a_schema_the_library_refuses_names_the_problem(grammars, schema, problem):
    with pytest.raises(GrammarError, match=problem) as caught:
        grammars.compile(StructuredOutput(schema))
    assert "cpp" not in str(caught.value)  # the library's source location is not the message
