"""What structured outputs and logprobs cost the decode loop, on the embedded model.

    .venv/bin/python -m benchmarks.sampling_cost [--rounds 3] [--batch 8] [--tokens 64]

One engine (`LLM`, policy fcfs: nothing paced or paused), a batch of `--batch` streams of
`--tokens` tokens each, the same prompts every run; three variants against the plain batch,
interleaved A B B A over `--rounds` rounds:

- `json_schema`: every stream held to a schema whose answer is longer than `--tokens` (a string
  of at least 400 characters), so each runs to its length like the plain ones;
- `logprobs`: every stream asks for its tokens' logprobs and 5 alternatives;
- `plain`: `ignore_eos`, the same length.

Prints output tokens/s per variant and each variant's ratio to the plain run of its round,
median [min-max] over the rounds.  The time includes the (short) prompts' prefill, the same for
every variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tokenflow.core.request import SamplingParams, StructuredOutput
from tokenflow.engine.llm import LLM
from tokenflow.eval.rounds import run_rounds

SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "string", "minLength": 400}},
    "required": ["notes"],
}
PROMPT = "Write a long note about the weather in Paris, as JSON."
VARIANTS = ("plain", "json_schema", "logprobs")


def params_of(variant: str, tokens: int) -> SamplingParams:
    """The sampling parameters of one variant's streams (greedy, `tokens` long)."""
    if variant == "plain":
        return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    if variant == "json_schema":
        schema = StructuredOutput(json.dumps(SCHEMA))
        return SamplingParams(max_tokens=tokens, temperature=0.0, structured_output=schema)
    if variant == "logprobs":
        return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    raise ValueError(f"unknown variant {variant!r}")


def tokens_per_s(llm: LLM, variant: str, batch: int, tokens: int) -> float:
    """Output tokens/s of one batch of `variant` streams."""
    params = params_of(variant, tokens)
    start = time.perf_counter()
    outputs = llm.generate([PROMPT] * batch, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outputs) / elapsed


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    llm = LLM(policy="fcfs")
    for variant in VARIANTS:  # warm-up: the kernels, the grammar compiler
        tokens_per_s(llm, variant, args.batch, 4)
    rounds = run_rounds(
        VARIANTS,
        args.rounds,
        lambda _, variant: tokens_per_s(llm, variant, args.batch, args.tokens),
    )
    print(f"batch {args.batch}, {args.tokens} tokens a stream, {args.rounds} rounds A B B A")
    print("| variant | output tok/s | / plain |")
    print("|---|---|---|")
    for variant in VARIANTS:
        tps = [r[variant] for r in rounds]
        ratios = [r[variant] / r["plain"] for r in rounds]
        print(f"| {variant} | {spread(tps)} | {spread(ratios)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
