"""Streaming detokenization cost per token: two window decodes per token vs. `DecodeStream`.

Feeds the README's tokens one at a time (as the engine does, one output token per request and
step) through the previous window detokenizer and through `IncrementalDetokenizer`
(DecodeStream), alternating rounds; prints the median microseconds per token and checks that
both produce the same text.

    .venv/bin/python benchmarks/detokenize.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from tokenflow.engine import IncrementalDetokenizer, load_model  # noqa: E402
from tokenflow.engine.tokenizer import Tokenizer  # noqa: E402


def window_detokenize(tokenizer: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    """The previous algorithm: decode the prefix window and the full window for every token."""
    window = list(prompt[-5:])
    prefix_offset, read_offset = 0, len(window)
    text = ""
    for token_id in ids:
        window.append(token_id)
        prefix = tokenizer.decode(window[prefix_offset:read_offset])
        full = tokenizer.decode(window[prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            text += full[len(prefix) :]
            prefix_offset, read_offset = read_offset, len(window)
    return text


def stream_detokenize(tokenizer: Tokenizer, prompt: list[int], ids: list[int]) -> str:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    for token_id in ids:
        detokenizer.push((token_id,))
    return detokenizer.text


def main() -> None:
    _, _, tokenizer = load_model(None, "cpu", None)
    readme = Path(__file__).resolve().parents[1] / "README.md"
    ids = tokenizer.encode(readme.read_text(encoding="utf-8"))[:4000]
    prompt, ids = ids[:8], ids[8:]
    assert window_detokenize(tokenizer, prompt, ids) == stream_detokenize(tokenizer, prompt, ids)
    times: dict[str, list[float]] = {"window": [], "stream": []}
    for _ in range(7):
        for name, run in (("window", window_detokenize), ("stream", stream_detokenize)):
            start = time.perf_counter()
            run(tokenizer, prompt, ids)
            times[name].append((time.perf_counter() - start) / len(ids) * 1e6)
    window, stream = (statistics.median(times[k]) for k in ("window", "stream"))
    print(f"{len(ids)} tokens; us/token: window decodes {window:.2f}, DecodeStream {stream:.2f}")
    print(f"speedup {window / stream:.2f}x (identical text)")


if __name__ == "__main__":
    main()
