"""A step's sampled tokens appended to their requests: the per-chunk half of `Scheduler.update`.

The scheduler hands over the requests of the plan's chunks in chunk order, the decodes first,
and the executor returns the tokens in that order too (step semantics 4, tokenflow.core.plan),
so each token meets its request by position instead of by a lookup per chunk.
"""

from __future__ import annotations

from tokenflow.core.plan import RequestOutput, SampledToken, ScheduledChunk, StepPlan
from tokenflow.core.queues import RequestQueues
from tokenflow.core.request import FinishReason, Request, RequestState


def check_sampled(
    plan: StepPlan, decoding: list[Request], sampled: tuple[SampledToken, ...], num_samples: int
) -> None:
    """ValueError unless `sampled` has `num_samples` tokens and the decodes' (`decoding`, the
    plan's first chunks) first and last are where the plan's order puts them (the executors'
    tests check the order in full)."""
    if len(sampled) != num_samples:
        raise ValueError(
            f"step {plan.step_index}: {len(sampled)} tokens sampled for {num_samples} chunks"
        )
    for index in (0, len(decoding) - 1) if decoding else ():
        due, got = decoding[index].request_id, sampled[index].request_id
        if got != due:
            raise ValueError(f"step {plan.step_index}: token {index} is {got!r}'s, not {due!r}'s")


class TokenAppender:
    """Appends sampled tokens to the requests of a step's chunks and reports them as outputs;
    an output that ends its request carries the reason (the scheduler then finishes it)."""

    def __init__(self, queues: RequestQueues, block_size: int, max_model_len: int) -> None:
        self._queues = queues
        self._block_size = block_size
        self._max_model_len = max_model_len

    def append_decodes(
        self, decoding: list[Request], sampled: tuple[SampledToken, ...], now_s: float
    ) -> list[RequestOutput]:
        """The decode chunks' tokens (`sampled` begins with them, in the same order).

        A running stream's `num_computed_tokens` is still its chunk's start position: nothing
        but finishing touches a resident between `schedule` and `update`."""
        outputs: list[RequestOutput] = []
        running, block_size, queues = RequestState.RUNNING, self._block_size, self._queues
        max_len, add = self._max_model_len, outputs.append
        for request, sample in zip(decoding, sampled, strict=False):  # (then the prefills')
            if request.state is not running:
                continue  # finished or aborted while the step ran
            token_id = sample.token_id
            request.num_computed_tokens += 1
            request.append_token(token_id, now_s)
            if not request.num_computed_tokens % block_size:  # the step filled a block
                queues.block_filled(request)
                queues.token_appended(request)
            stops = token_id in request.stop_token_set or request.is_at_output_limit(max_len)
            add(self._output(request, sample, self._stop_reason(request) if stops else None))
        return outputs

    def append_prefills(
        self,
        chunks: tuple[ScheduledChunk, ...],
        prefilling: list[Request],
        sampled: tuple[SampledToken, ...],
        now_s: float,
    ) -> list[RequestOutput]:
        """The other chunks' computed tokens and sampled tokens (`sampled`: theirs, in order)."""
        outputs: list[RequestOutput] = []
        block_size, queues, samples = self._block_size, self._queues, iter(sampled)
        for chunk, request in zip(chunks, prefilling, strict=True):
            sample = next(samples) if chunk.samples_token else None
            if request.state is not RequestState.RUNNING:
                continue  # finished or aborted while the step ran
            num_new = len(chunk.token_ids)
            computed = chunk.start_position + num_new
            filled = computed // block_size != request.num_computed_tokens // block_size
            if filled:
                queues.block_filled(request)
            request.num_computed_tokens = computed
            if sample is None:
                continue
            if sample.request_id != request.request_id:
                raise ValueError(
                    f"token of {sample.request_id!r} where {request.request_id!r}'s was due"
                )
            request.append_token(sample.token_id, now_s)
            if filled or num_new > 1:
                queues.token_appended(request)
            outputs.append(self._output(request, sample, self._stop_reason(request)))
        return outputs

    def _output(
        self, request: Request, sample: SampledToken, reason: FinishReason | None
    ) -> RequestOutput:
        """The output of a request that just sampled `sample`, with the reason it stops."""
        return RequestOutput(
            request.request_id,
            (sample.token_id,),
            request.num_output_tokens,
            reason,
            () if sample.logprobs is None else (sample.logprobs,),
            sample.prompt_logprobs,
            request.num_cached_tokens,
        )

    def _stop_reason(self, request: Request) -> FinishReason | None:
        """Why `request` stops after its newest token (None: it goes on)."""
        if (
            request.output_token_ids[-1] in request.stop_token_set
            and request.num_output_tokens >= request.sampling_params.min_tokens
        ):
            return FinishReason.STOP
        if request.is_at_output_limit(self._max_model_len):
            return FinishReason.LENGTH
        return None
