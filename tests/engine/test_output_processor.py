"""OutputProcessor on SmolLM2's tokenizer: stop strings over multi-byte and special tokens."""

from __future__ import annotations

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenflow.core.plan import RequestOutput
from tokenflow.core.request import FinishReason, SamplingParams
from tokenflow.engine import output_processor
from tokenflow.engine.output_processor import OutputProcessor
from tokenflow.model.tokenizer import (
    IncrementalDetokenizer,
    StopMatcher,
    Tokenizer,
    find_stop,
    partial_stop_length,
)

TEXT = "Grüße 🤖 aus 日本語! <|im_end|> then more text"


def _stream(smollm, text: str, stop: tuple[str, ...], finish_last: bool = True):
    """Feed `text`'s tokens one per step; return the deltas until a finish."""
    tokenizer = smollm.tokenizer
    ids = tokenizer.encode(text)
    processor = OutputProcessor(tokenizer)
    processor.add("r", tokenizer.encode("Prompt:"), SamplingParams(max_tokens=64, stop=stop))
    deltas = []
    for index, token_id in enumerate(ids):
        is_last = finish_last and index == len(ids) - 1
        finish = FinishReason.LENGTH if is_last else None
        step = processor.process([RequestOutput("r", (token_id,), index + 1, finish)])
        deltas += step.deltas
        if deltas[-1].finish_reason is not None:
            assert step.stopped_request_ids == (["r"] if deltas[-1].finish_reason == "stop" else [])
            break
    return deltas


@pytest.mark.parametrize("stop", ["🤖", "日本", "語!", "<|im_end|>", "more"])
def test_stop_string_cuts_the_text_before_it(smollm, stop):
    decoded = smollm.tokenizer.decode(smollm.tokenizer.encode(TEXT))  # special tokens dropped
    expected = decoded[: decoded.find(stop)] if stop in decoded else decoded
    deltas = _stream(smollm, TEXT, (stop,))
    assert "".join(d.text for d in deltas) == expected
    assert deltas[-1].finish_reason == ("stop" if stop in decoded else "length")
    assert all("\ufffd" not in d.text for d in deltas)


def test_without_stops_every_character_arrives_once(smollm):
    deltas = _stream(smollm, TEXT, ())
    assert "".join(d.text for d in deltas) == smollm.tokenizer.decode(smollm.tokenizer.encode(TEXT))
    assert deltas[-1].finish_reason == "length"


def _byte_tokenizer() -> Tokenizer:
    """One token per UTF-8 byte: a multi-byte character spans tokens and is held back."""
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    model = tokenizers.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[])
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    return Tokenizer(backend, None)


BYTES = _byte_tokenizer()


def _steps(text: str, chunk: int) -> list[tuple[int, ...]]:
    ids = BYTES.encode(text)
    return [tuple(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]


def _processed(steps, stops, finish_last: bool) -> list[tuple[str, str | None]]:
    processor = OutputProcessor(BYTES)
    processor.add("r", [], SamplingParams(max_tokens=4096, stop=stops))
    deltas, total = [], 0
    for index, ids in enumerate(steps):
        total += len(ids)
        last = finish_last and index == len(steps) - 1
        output = RequestOutput("r", ids, total, FinishReason.LENGTH if last else None)
        (delta,) = processor.process([output]).deltas
        deltas.append((delta.text, delta.finish_reason))
        if delta.finish_reason is not None:
            break
    return deltas


def _before_stop_matcher(steps, stops, finish_last: bool) -> list[tuple[str, str | None]]:
    """The reference: the processor as it was, find_stop and partial_stop_length on the
    whole text at every step."""
    detok, sent, deltas = IncrementalDetokenizer(BYTES, []), 0, []
    for index, ids in enumerate(steps):
        detok.push(ids)
        finish = "length" if finish_last and index == len(steps) - 1 else None
        if finish is not None:
            detok.flush()
        text = detok.text
        end = len(text)
        if stops:
            cut = find_stop(text, stops, max(0, sent - max(len(s) for s in stops)))
            if cut is not None:
                end, finish = cut, "stop"
            elif finish is None:
                end -= partial_stop_length(text, stops)
        end = max(end, sent)
        deltas.append((text[sent:end], finish))
        sent = end
        if finish is not None:
            break
    return deltas


_ALPHABET = "ab é🤖"  # 1-, 2- and 4-byte characters


@settings(max_examples=200, deadline=None, database=None)
@given(
    text=st.text(_ALPHABET, max_size=30),
    stops=st.lists(st.text(_ALPHABET, max_size=4), max_size=4).map(tuple),
    chunk=st.integers(1, 3),
    finish_last=st.booleans(),
)
def test_deltas_equal_the_whole_text_reference(text, stops, chunk, finish_last):
    """Same texts, same held-back suffixes, same cut and finish at every step as before."""
    steps = _steps(text, chunk)
    expected = _before_stop_matcher(steps, stops, finish_last)
    assert _processed(steps, stops, finish_last) == expected


def test_the_matcher_sees_each_character_once(monkeypatch):
    """16 stops of 256 characters, 1,000 one-character tokens: the processor feeds the matcher
    only the new text of each step, and the matcher's work stays under 2 lookups a character."""
    matchers: list[StopMatcher] = []

    class Recording(StopMatcher):
        def __init__(self, stops) -> None:
            super().__init__(stops)
            self.pieces: list[str] = []
            matchers.append(self)

        def feed(self, text: str) -> int | None:
            self.pieces.append(text)
            return super().feed(text)

    monkeypatch.setattr(output_processor, "StopMatcher", Recording)
    stops = tuple(("ab" * 128)[:255] + chr(ord("c") + i) for i in range(16))
    text = ("ab" * 600)[:999] + "!"
    deltas = _processed(_steps(text, 1), stops, finish_last=True)
    assert "".join(t for t, _ in deltas) == text and deltas[-1][1] == "length"
    (matcher,) = matchers
    assert matcher.pieces == list(text)
    assert matcher.num_steps <= 2 * len(text)


def _word_piece_tokenizer() -> Tokenizer:
    """Words and two added special tokens, decoded with spaces between them (WordPiece)."""
    vocab = {"hi": 0, "there": 1, "[UNK]": 2}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.decoder = tokenizers.decoders.WordPiece()
    backend.add_special_tokens(["<a>", "<b>"])
    return Tokenizer(backend, None)


def _text_of(tokenizer: Tokenizer, text: str, **params) -> str:
    """The whole text of `text`'s tokens, one per step, under SamplingParams(**params)."""
    ids = tokenizer.encode(text)
    processor = OutputProcessor(tokenizer)
    processor.add("r", [], SamplingParams(max_tokens=64, **params))
    pieces = []
    for index, token_id in enumerate(ids):
        finish = FinishReason.LENGTH if index == len(ids) - 1 else None
        (delta,) = processor.process([RequestOutput("r", (token_id,), index + 1, finish)]).deltas
        pieces.append(delta.text)
        if delta.finish_reason is not None:
            break
    return "".join(pieces)


def test_special_tokens_are_kept_when_not_skipped_and_joined_without_spaces():
    words = _word_piece_tokenizer()
    assert _text_of(words, "hi <a> <b> there") == "hi there"
    assert _text_of(words, "hi <a> <b> there", skip_special_tokens=False) == "hi <a> <b> there"
    joined = _text_of(
        words, "hi <a> <b> there", skip_special_tokens=False, spaces_between_special_tokens=False
    )
    assert joined == "hi <a><b> there"


def test_special_tokens_of_a_real_tokenizer_are_kept_when_not_skipped(smollm):
    text = _text_of(smollm.tokenizer, TEXT, skip_special_tokens=False)
    assert "<|im_end|>" in text
    assert "<|im_end|>" not in _text_of(smollm.tokenizer, TEXT)


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("stop", ["日本", "text", "ß"])
def test_a_kept_stop_string_ends_the_text(stop, chunk):
    processor = OutputProcessor(BYTES)
    params = SamplingParams(max_tokens=4096, stop=(stop,), include_stop_str_in_output=True)
    processor.add("r", [], params)
    steps, texts, total, finish = _steps(TEXT, chunk), [], 0, None
    for ids in steps:
        total += len(ids)
        (delta,) = processor.process([RequestOutput("r", ids, total, None)]).deltas
        texts.append(delta.text)
        finish = delta.finish_reason
        if finish is not None:
            break
    assert "".join(texts) == TEXT[: TEXT.find(stop) + len(stop)]
    assert finish == "stop"
