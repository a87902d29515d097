"""Turns the core's per-token outputs into text deltas: detokenization and stop strings.

Stop strings are found here, not in the core (the core sees only token ids); when one matches,
the text is cut before it (after it with `include_stop_str_in_output`) and the caller finishes
the request in the core.  While streaming, a suffix that could still grow into a stop string is
held back until the next token decides it (not when a stop is kept: the text is sent either
way).
Each request's `StopMatcher` sees each character once, so a step costs O(its new text) there,
however long the stops and the text so far.

A request whose detokenization or stop check raises gets an "error" delta and is listed in
`ProcessedStep.failed_request_ids` (the caller ends it in the core); the others go on.  An
output the core ended with an `error` (its sampling row failed) gets an "error" delta with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenflow.core.plan import RequestOutput
from tokenflow.core.request import SamplingParams
from tokenflow.engine.client import GenerationDelta
from tokenflow.model.tokenizer import IncrementalDetokenizer, StopMatcher, Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopMatcher | None  # None without (non-empty) stop strings
    num_prompt_tokens: int
    keeps_stop: bool = False  # a stop string that ends the text stays in it
    num_sent_chars: int = 0
    num_output_tokens: int = 0


@dataclass(frozen=True)
class ProcessedStep:
    deltas: list[GenerationDelta]
    stopped_request_ids: list[str]  # hit a stop string: finish them in the core
    failed_request_ids: list[str]  # their text could not be produced: abort them in the core


class OutputProcessor:
    """Per-request text state; one instance per engine."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._streams: dict[str, _Stream] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Start tracking a request."""
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        self._streams[request_id] = _Stream(
            detokenizer,
            StopMatcher(params.stop) if any(params.stop) else None,
            len(prompt_token_ids),
            keeps_stop=params.include_stop_str_in_output,
        )

    def resume(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int],
    ) -> None:
        """Track a stream that another engine started (moved here): its text state is rebuilt
        from the tokens it produced there, so its next delta holds the text after what that
        engine sent (a suffix that could grow into a stop string still held back)."""
        self.add(request_id, prompt_token_ids, params)
        stream = self._streams[request_id]
        stream.detokenizer.push(output_token_ids)
        end = len(stream.detokenizer.text)
        if stream.stop_matcher is not None:
            if stream.stop_matcher.feed(stream.detokenizer.text) is not None:
                self.drop(request_id)
                raise ValueError(f"{request_id}: its text so far already holds a stop string")
            end -= 0 if stream.keeps_stop else stream.stop_matcher.partial_length
        stream.num_sent_chars = end
        stream.num_output_tokens = len(output_token_ids)

    def drop(self, request_id: str) -> None:
        """Forget a request (aborted or finished)."""
        self._streams.pop(request_id, None)

    def process(self, outputs: list[RequestOutput]) -> ProcessedStep:
        """Deltas for one step's outputs, the requests a stop string ended and those that failed."""
        deltas: list[GenerationDelta] = []
        stopped: list[str] = []
        failed: list[str] = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.error is not None:  # the core ended it: its sampling row failed
                logger.warning("request %s failed alone: %s", output.request_id, output.error)
                delta = self._error_delta(output.request_id, stream, output.error)
            else:
                try:
                    delta = self._advance(stream, output)
                except Exception as err:  # noqa: BLE001 - attributed to this request alone
                    logger.exception("request %s: producing its text failed", output.request_id)
                    reason = f"detokenization: {err}"
                    delta = self._error_delta(output.request_id, stream, reason)
                    if output.finish_reason is None:
                        failed.append(output.request_id)
            if delta.finish_reason == "stop" and output.finish_reason is None:
                stopped.append(output.request_id)
            if delta.finish_reason is not None:
                self.drop(output.request_id)
            deltas.append(delta)
        return ProcessedStep(deltas, stopped, failed)

    def failed(self, request_id: str, reason: str) -> GenerationDelta | None:
        """The closing "error" delta of a request that failed (None if it was not tracked)."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return None
        return self._error_delta(request_id, stream, reason)

    @staticmethod
    def _error_delta(request_id: str, stream: _Stream, reason: str) -> GenerationDelta:
        return GenerationDelta(
            request_id,
            (),
            "",
            stream.num_prompt_tokens,
            stream.num_output_tokens,
            "error",
            error=reason,
        )

    def _advance(self, stream: _Stream, output: RequestOutput) -> GenerationDelta:
        detok = stream.detokenizer
        detok.push(output.new_token_ids)
        finish = output.finish_reason.value if output.finish_reason else None
        if finish is not None:
            detok.flush()
        text = detok.text
        stream.num_output_tokens = output.num_output_tokens
        end = len(text)
        matcher = stream.stop_matcher
        if matcher is not None:  # fed only the text it has not seen: O(new text) per step
            cut = matcher.feed(text[matcher.num_fed_chars :])
            if cut is not None:
                end, finish = cut + (matcher.stop_length if stream.keeps_stop else 0), "stop"
            elif finish is None and not stream.keeps_stop:
                end -= matcher.partial_length
        end = max(end, stream.num_sent_chars)
        new_text = text[stream.num_sent_chars : end]
        stream.num_sent_chars = end
        return GenerationDelta(
            request_id=output.request_id,
            token_ids=output.new_token_ids,
            text=new_text,
            num_prompt_tokens=stream.num_prompt_tokens,
            num_output_tokens=output.num_output_tokens,
            finish_reason=finish,
            logprobs=output.new_logprobs,
            prompt_logprobs=output.prompt_logprobs,
            num_cached_tokens=output.num_cached_tokens,
        )

    def aborted(self, request_id: str) -> GenerationDelta | None:
        """The closing delta of an aborted request (None if it was not tracked)."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return None
        return GenerationDelta(
            request_id, (), "", stream.num_prompt_tokens, stream.num_output_tokens, "abort"
        )
