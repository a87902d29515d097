"""A stream's portable state: what moves when a request leaves one engine for another.

A request is exported between steps (`Scheduler.export_stream`): the engine forgets it and
frees its KV in both tiers.  Its `StreamExport` holds everything another engine needs to go on
as if nothing happened: the prompt and the tokens generated so far (so the target recomputes
the context and samples the next token where the source would have), the sampling parameters
with the per-request seed, and the reader's clock (when each token was delivered, the rate, the
virtual buffer's last consumption time), so the reader's slack continues across the move.

Imported (`Scheduler.import_stream`), a started stream enters as a paused stream with no KV, and
resumes by recompute when the target's policy starts it; a request that never started re-enters
the waiting queue, keeping its arrival time, so its TTFT still counts from its arrival.

Nothing random stays behind: the real engine's sampler draws each token from a function of the
stream's seed and the token's position (tokenflow/model/sampler.py), and its penalties count the
recomputed chunks' own tokens (tokenflow/model/penalties.py), so a seeded stream continues with
the tokens it would have produced (tests/runtime/test_migration_exact.py); an unseeded one draws
from the engine seed and its request id, the same on a target started with the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tokenflow.core.request import (
    Consumption,
    Request,
    SamplingParams,
    reader_dry_s,
    reader_slack_s,
)

# What a move costs beyond the target's recompute and the source's wait for the end of its step:
# the handoff of the state through the ingress and the call that opens the continuation on the
# target.  The state is token ids (8 bytes a token: ~20 KB for a 2,560-token stream), so the cost
# is the calls.  Measured on Ray Serve (two replicas on one node, this project's 2-core CPU): the
# median from the source's handoff to the target's landing over 18 moves, 14-74 ms
# (`python -m benchmarks.move_cost --real`, docs/replicas.md).
MOVE_LATENCY_S = 0.018


@dataclass(frozen=True)
class StreamExport:
    """One stream, as it leaves an engine (times on the fleet's common clock, seconds)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # generated so far: the target's recompute covers them
    sampling_params: SamplingParams  # the per-request seed included
    eos_token_ids: tuple[int, ...]
    consumption: Consumption  # the request's class: reader, eager or batch
    arrival_s: float  # when the request first arrived (its TTFT counts from here)
    rate_tps: float  # the reader's tokens/s
    token_times_s: tuple[float, ...]  # when each generated token was delivered
    last_consume_s: float  # the reader's consumption time of the newest token
    num_preemptions: int
    session_key: str | None = None  # the client's session hint (OpenAI's prompt_cache_key)

    @property
    def is_started(self) -> bool:
        """Whether it has produced a token (it then resumes paused, else it waits)."""
        return bool(self.output_token_ids)

    @property
    def num_delivered_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_context_tokens(self) -> int:
        """Prompt + generated: what the target recomputes before its next token."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def consumption_start_s(self) -> float | None:
        """When the reader started reading (its first token); None before it."""
        return self.token_times_s[0] if self.token_times_s else None

    def shifted(self, by_s: float) -> StreamExport:
        """The same stream with every time moved by `by_s` seconds: engines on clocks of their
        own exchange states with times relative to the export (`by_s` = -now there, + now on
        import), so the reader's slack carries over whatever each clock's origin."""
        return replace(
            self,
            arrival_s=self.arrival_s + by_s,
            token_times_s=tuple(t + by_s for t in self.token_times_s),
            last_consume_s=self.last_consume_s + by_s,
        )

    def slack_s(self, now_s: float) -> float:
        """Seconds until the reader asks for a token not generated yet (`Request.slack_s`)."""
        dry_s = reader_dry_s(self.last_consume_s, self.rate_tps)
        return reader_slack_s(self.is_started, dry_s, now_s)


def export_of(request: Request) -> StreamExport:
    """The portable state of `request` (nothing about where its KV is: it does not move)."""
    return StreamExport(
        request_id=request.request_id,
        prompt_token_ids=tuple(request.prompt_token_ids),
        output_token_ids=tuple(request.output_token_ids),
        sampling_params=request.sampling_params,
        eos_token_ids=tuple(request.eos_token_ids),
        consumption=request.consumption,
        arrival_s=request.arrival_s,
        rate_tps=request.rate_tps,
        token_times_s=tuple(request.token_times_s),
        last_consume_s=request.last_consume_s,
        num_preemptions=request.num_preemptions,
        session_key=request.session_key,
    )


def request_of(state: StreamExport) -> Request:
    """A new core request that goes on from `state`: no KV yet (num_computed_tokens 0)."""
    return Request(
        request_id=state.request_id,
        prompt_token_ids=state.prompt_token_ids,
        sampling_params=state.sampling_params,
        rate_tps=state.rate_tps,
        arrival_s=state.arrival_s,
        eos_token_ids=state.eos_token_ids,
        consumption=state.consumption,
        output_token_ids=list(state.output_token_ids),
        token_times_s=list(state.token_times_s),
        num_preemptions=state.num_preemptions,
        last_consume_s=state.last_consume_s,
        session_key=state.session_key,
    )
