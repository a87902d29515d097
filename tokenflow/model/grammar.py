"""Structured outputs: one grammar matcher per constrained request, masking its logits row.

A request's `StructuredOutput` (a JSON Schema) is compiled by xgrammar against the tokenizer's
vocabulary, in worker processes with a deadline and a cache (`grammar_compile.py`): the server
compiles before it submits the request and hands the compiled grammar over (`bind`), so no
compile runs on the engine thread; only the offline API and a moved stream's import compile
where they are called.  Each step, every row
of a constrained request gets the token mask its matcher allows next (disallowed logits become
-inf); rows without a grammar are untouched, so constrained and free streams share one batch.
After sampling, each constrained request's matcher accepts its token.  The end-of-sequence
tokens are allowed only where the value is complete.

Where the state lives: the matchers are kept here, keyed by request id, outside the KV cache,
created from the bound grammar at a request's first sampled token and dropped only when the
request is released.  A
paused stream (offloaded and reloaded, or dropped and recomputed) keeps its matcher untouched:
a recompute prefills prompt + outputs without sampling until its last position, so the matcher
advances exactly once per generated token and a resumed stream is constrained exactly as an
unpaused one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar

from tokenflow.core.request import SamplingParams, StructuredOutput
from tokenflow.model.grammar_compile import (
    DEFAULT_NUM_WORKERS,
    DEFAULT_TIMEOUT_S,
    GrammarCompiler,
    GrammarError,
)
from tokenflow.model.tokenizer import Tokenizer

_BITS_PER_WORD = 32  # xgrammar's bitmask: one int32 word per 32 tokens
CompiledGrammar = xgrammar.CompiledGrammar
__all__ = ["CompiledGrammar", "GrammarError", "Grammars"]


class Grammars:
    """The compiler for one tokenizer and the matchers of the constrained requests."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        compile_workers: int = DEFAULT_NUM_WORKERS,
        compile_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        info = xgrammar.TokenizerInfo(
            encoded_vocab(tokenizer),
            _vocab_type(tokenizer),
            vocab_size=vocab_size,
            stop_token_ids=list(stop_token_ids),
        )
        self.vocab_size = vocab_size
        self.compiler = GrammarCompiler(
            info, num_workers=compile_workers, timeout_s=compile_timeout_s
        )
        self._bound: dict[str, xgrammar.CompiledGrammar] = {}
        self._matchers: dict[str, xgrammar.GrammarMatcher] = {}

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)

    def compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The compiled grammar of `spec` (cached), compiled in a worker process: blocks the
        calling thread up to the compile deadline.  A ValueError naming what is wrong
        (GrammarError, SchemaTooComplex); CompilerBusy when no worker was free in time."""
        return self.compiler.compile(spec)

    def bind(self, request_id: str, grammar: xgrammar.CompiledGrammar) -> None:
        """The request's grammar, compiled beforehand (`compile`), for its matcher."""
        self._bound[request_id] = grammar

    def release(self, request_ids: Sequence[str]) -> None:
        """Forget the grammars and matchers of requests that are gone."""
        for request_id in request_ids:
            self._matchers.pop(request_id, None)
            self._bound.pop(request_id, None)

    def close(self) -> None:
        """Stop the compile workers."""
        self.compiler.close()

    def mask(
        self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams]
    ) -> None:
        """Set to -inf, in place, what each constrained row's grammar forbids next.

        logits [num_rows, vocab]; row i belongs to request_ids[i] sampled with params[i].
        """
        rows = [i for i, p in enumerate(params) if p.structured_output is not None]
        if not rows:
            return
        bitmask = xgrammar.allocate_token_bitmask(len(rows), self.vocab_size)  # [R, words]
        for slot, row in enumerate(rows):
            self._matcher(request_ids[row], params[row]).fill_next_token_bitmask(bitmask, slot)
        index = torch.tensor(rows, device=logits.device)
        allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])  # [R, vocab]
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))

    def accept(
        self, request_ids: Sequence[str], token_ids: Sequence[int], failed_rows: dict[str, str]
    ) -> None:
        """Advance each constrained request's matcher by its sampled token; a token its
        grammar refuses (nothing was allowed) fails that request alone, in `failed_rows`."""
        for request_id, token_id in zip(request_ids, token_ids, strict=True):
            matcher = self._matchers.get(request_id)
            if matcher is None or request_id in failed_rows:
                continue
            if not matcher.accept_token(token_id):
                failed_rows[request_id] = f"the output's grammar does not allow token {token_id}"

    def resume(
        self,
        request_id: str,
        params: SamplingParams,
        output_token_ids: Sequence[int],
        grammar: xgrammar.CompiledGrammar | None = None,
    ) -> None:
        """A request moved in from another engine with `output_token_ids` generated there: its
        matcher, advanced by each of them, is where the source's was (a matcher's state is a
        function of its grammar and the tokens it accepted).  `grammar`: compiled beforehand
        (else compiled here).  ValueError if the grammar refuses one of them."""
        if params.structured_output is None:
            return
        grammar = grammar or self.compile(params.structured_output)
        matcher = xgrammar.GrammarMatcher(grammar)
        for position, token_id in enumerate(output_token_ids):
            if not matcher.accept_token(token_id):
                raise ValueError(
                    f"the output's grammar does not allow token {token_id} at position {position}"
                )
        self._matchers[request_id] = matcher

    def _matcher(self, request_id: str, params: SamplingParams) -> xgrammar.GrammarMatcher:
        """The request's matcher, made at its first constrained row (mask() only asks for
        rows with a structured output) from its bound grammar, or (the offline API, which
        binds none) compiled here."""
        matcher = self._matchers.get(request_id)
        if matcher is None and params.structured_output is not None:
            grammar = self._bound.get(request_id) or self.compile(params.structured_output)
            matcher = xgrammar.GrammarMatcher(grammar)
            self._matchers[request_id] = matcher
        return matcher


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [R, words] int32 (bit j of word w: token 32 w + j) -> allowed [R, vocab] bool."""
    shifts = torch.arange(_BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [R, words, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def encoded_vocab(tokenizer: Tokenizer) -> list[str]:
    """Every token's vocabulary form by id; special tokens as "" (xgrammar never allows an
    empty token inside a value, so `<|im_start|>` cannot appear in a JSON string)."""
    backend = tokenizer.backend
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    return [
        "" if i in special else (backend.id_to_token(i) or "") for i in range(tokenizer.vocab_size)
    ]


def _vocab_type(tokenizer: Tokenizer) -> xgrammar.VocabType:
    """How the vocabulary spells bytes: byte-level BPE (GPT-2 style), byte fallback
    (SentencePiece's `<0x0A>`), or raw text."""
    decoder = str(tokenizer.backend.decoder)
    if "ByteLevel" in decoder:
        return xgrammar.VocabType.BYTE_LEVEL
    if "ByteFallback" in decoder:
        return xgrammar.VocabType.BYTE_FALLBACK
    return xgrammar.VocabType.RAW
