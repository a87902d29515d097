"""Where every unfinished request is, with the orders and sums the hot paths read.

The scheduler moves requests between the queues through these methods only, so the derived
structures (paused streams by dry time, loads in flight, the residents' remaining output, the
streams with KV to write through) stay exact without any step rescanning every request.
"""

from __future__ import annotations

import bisect

from tokenflow.core.request import Request, RequestState


def _arrival(request: Request) -> tuple[float, int]:
    return (request.arrival_s, request.arrival_index)


def _dry_then_arrival(request: Request) -> tuple[float, float, int]:
    return (request.dry_s, request.arrival_s, request.arrival_index)


def _remaining(request: Request) -> int:
    return request.sampling_params.max_tokens - request.num_output_tokens


def lifetime_blocks_of(request: Request, block_size: int) -> int:
    """Blocks at max(tokens, prompt + max_tokens // 2): a member's mean lifetime footprint."""
    return -(-max(request.num_tokens, request.lifetime_tokens) // block_size)


class RequestQueues:
    """Waiting, resident and paused requests (all in first-come-first-served order)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.waiting: list[Request] = []  # never started
        self.running: list[Request] = []  # resident (RUNNING or LOADING), in order of start
        self.running_by_arrival: list[Request] = []  # the same, by arrival
        self.preempted: list[Request] = []  # started once, now off the device
        self.preempted_by_dry: list[
            Request
        ] = []  # the same, by (dry_s, arrival): fixed while paused
        self.loading: list[Request] = []  # residents whose KV is still being loaded
        self.remaining_output_tokens = 0  # max_tokens - generated, summed over the residents
        self.resident_tokens = 0  # num_tokens, summed over the residents
        self.started_lifetime_blocks = 0  # lifetime_blocks_of, summed over running + paused
        self.started_rates: dict[float, int] = {}  # reading rate -> members (running + paused)
        # Residents that may have a full block without a host copy (a superset: a stream joins
        # when a step fills one of its blocks and leaves once write-through has caught up).
        self.write_candidates: dict[str, Request] = {}
        # Residents that may not be decoding (a superset: a stream joins when it enters the
        # device and leaves once it has sampled a token in a step that filled a block or ran a
        # prefill); every other resident with a token is decoding.
        self.unsettled: dict[str, Request] = {}

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.preempted)

    def add_waiting(self, request: Request) -> None:
        request.state = RequestState.WAITING
        bisect.insort(self.waiting, request, key=_arrival)

    def enter_device(self, request: Request, state: RequestState) -> None:
        """A waiting or paused request starts running, or loading (`state`)."""
        if request.state is RequestState.WAITING:
            self.waiting.remove(request)
            self.started_lifetime_blocks += lifetime_blocks_of(request, self.block_size)
            rate, rates = float(request.rate_tps), self.started_rates
            rates[rate] = rates.get(rate, 0) + 1
        else:
            self._leave_preempted(request)
        request.state = state
        self.running.append(request)
        bisect.insort(self.running_by_arrival, request, key=_arrival)
        self.unsettled[request.request_id] = request
        if state is RequestState.LOADING:
            self.loading.append(request)
        self.remaining_output_tokens += (
            request.sampling_params.max_tokens - request.num_output_tokens
        )
        self.resident_tokens += request.num_tokens

    def load_finished(self, request: Request) -> None:
        """A loading request's KV is all on the device: it runs from the next step."""
        request.state = RequestState.RUNNING
        self.loading.remove(request)

    def pause(self, request: Request) -> None:
        """A resident request goes off the device."""
        self._leave_device(request)
        request.state = RequestState.PREEMPTED
        bisect.insort(self.preempted, request, key=_arrival)
        bisect.insort(self.preempted_by_dry, request, key=_dry_then_arrival)

    def remove(self, request: Request) -> None:
        """A request ends, from whichever queue holds it (its state is then set by the caller)."""
        if request.state is RequestState.WAITING:
            self.waiting.remove(request)
            return
        self.started_lifetime_blocks -= lifetime_blocks_of(request, self.block_size)
        rate, rates = float(request.rate_tps), self.started_rates
        rates[rate] -= 1
        if not rates[rate]:
            del rates[rate]
        if request.state is RequestState.PREEMPTED:
            self._leave_preempted(request)
        else:
            self._leave_device(request)

    def block_filled(self, request: Request) -> None:
        """A step filled one of a resident's blocks: it has KV to write through."""
        self.write_candidates[request.request_id] = request

    def token_appended(self, request: Request) -> None:
        """A resident gained a token in a step that filled one of its blocks or ran a prefill
        (call after `Request.append_token`): past its mean length, its lifetime grows a block
        at each block boundary; and it is decoding now."""
        before = request.num_tokens - 1
        if before % self.block_size == 0 and before >= request.lifetime_tokens:
            self.started_lifetime_blocks += 1
        self.unsettled.pop(request.request_id, None)  # it just sampled a token: decoding

    def _leave_preempted(self, request: Request) -> None:
        self.preempted.remove(request)
        self.preempted_by_dry.remove(request)

    def _leave_device(self, request: Request) -> None:
        self.running.remove(request)
        self.running_by_arrival.remove(request)
        if request.state is RequestState.LOADING:
            self.loading.remove(request)
        self.remaining_output_tokens -= (
            request.sampling_params.max_tokens - request.num_output_tokens
        )
        self.resident_tokens -= request.num_tokens
        self.write_candidates.pop(request.request_id, None)
        self.unsettled.pop(request.request_id, None)
