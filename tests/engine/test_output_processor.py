"""OutputProcessor on SmolLM2's tokenizer: stop strings over multi-byte and special tokens."""

from __future__ import annotations

import pytest

from tokenflow.core.plan import RequestOutput
from tokenflow.core.request import FinishReason, SamplingParams
from tokenflow.engine.output_processor import OutputProcessor

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
