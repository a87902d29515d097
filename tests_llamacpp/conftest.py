"""Fixtures for the llama.cpp executor's tests (run by `make test-llamacpp`)."""

from __future__ import annotations

import llama_cpp
import numpy as np
import pytest
from llama_cpp import Llama

from tokenflow.integrations.llamacpp.context import ContextSpec
from tokenflow.integrations.llamacpp.executor import LlamaCppExecutor
from tokenflow.model.loader import read_gguf_header

# llama.cpp's logits depend on the batch around them and on where in its pool of cells a
# sequence's KV sits (its kernels change with the batch's size; attention sums the cells in
# pool order): the same prompt alone and in a batch of 8 differed by up to 0.47 in a logit.  So
# a sequence may leave the prompt-alone greedy path only where that path's best token led the
# second by less than this.
NEAR_TIE = 1.0


def agrees_but_at_a_near_tie(ours: list[int], reference: list[int], margins: list[float]) -> bool:
    """True if `ours` equals `reference`, or first differs where the reference nearly tied."""
    first = next((i for i, (a, b) in enumerate(zip(ours, reference, strict=True)) if a != b), None)
    return first is None or margins[first] < NEAR_TIE


@pytest.fixture(scope="session")
def gguf():
    """The embedded SmolLM2 GGUF's path, config and tokenizer (a GGUFHeader)."""
    return read_gguf_header(None)


def make_executor(gguf, num_ctx_tokens: int = 2048, num_seqs: int = 8) -> LlamaCppExecutor:
    path, config, _ = gguf
    spec = ContextSpec(num_ctx_tokens, max_batch_tokens=1024, num_seqs=num_seqs, num_threads=2)
    return LlamaCppExecutor(path, spec, config.eos_token_ids)


_default_model_params = llama_cpp.llama_cpp.llama_model_default_params


def _without_repacking() -> llama_cpp.llama_model_params:
    """llama.cpp's default model parameters with weight repacking off, as the executor runs."""
    params = _default_model_params()
    params.use_extra_bufts = False
    return params


@pytest.fixture(scope="session")
def oracle(gguf):
    """Greedy continuation (EOS masked) of one prompt alone, through llama-cpp-python's own
    `Llama` class: another code path over the same library (repacking off, as ours)."""
    path, config, _ = gguf
    with pytest.MonkeyPatch.context() as patch:  # `Llama` has no option for it
        patch.setattr(llama_cpp.llama_cpp, "llama_model_default_params", _without_repacking)
        llm = Llama(str(path), n_ctx=512, n_threads=2, logits_all=True, verbose=False)
    cache: dict[tuple[tuple[int, ...], int], tuple[list[int], list[float]]] = {}

    def greedy_with_margins(prompt: list[int], num_new: int) -> tuple[list[int], list[float]]:
        """The tokens, and at each the lead of the best logit over the second best."""
        key = (tuple(prompt), num_new)
        if key not in cache:
            llm.reset()
            llm.eval(prompt)
            out: list[int] = []
            margins: list[float] = []
            for _ in range(num_new):
                logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
                logits[list(config.eos_token_ids)] = -np.inf
                second, best = np.partition(logits, -2)[-2:]
                out.append(int(logits.argmax()))
                margins.append(float(best - second))
                llm.eval([out[-1]])
            cache[key] = (out, margins)
        return cache[key]

    def greedy(prompt: list[int], num_new: int) -> list[int]:
        return greedy_with_margins(prompt, num_new)[0]

    greedy.with_margins = greedy_with_margins
    return greedy
