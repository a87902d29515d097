"""Where every unfinished request is, with the orders and the sum the per-step paths read.

The scheduler moves requests between the queues through these methods only, so the derived
structures (loads in flight, the streams with KV to write through, the residents that may not
be decoding, the residents' remaining output) stay exact without any step rescanning every
request.
"""

from __future__ import annotations

import bisect

from tokenflow.core.request import Request, RequestState


def _arrival(request: Request) -> tuple[float, int]:
    return request.sort_key


class RequestQueues:
    """Waiting, resident and paused requests (all in first-come-first-served order)."""

    def __init__(self) -> None:
        self.waiting: list[Request] = []  # never started, by arrival
        self.running: list[Request] = []  # resident (RUNNING or LOADING), in order of start
        self.preempted: list[Request] = []  # started once, now off the device, by arrival
        self.loading: list[Request] = []  # residents whose KV is still being loaded
        self.remaining_output_tokens = 0  # max_tokens - generated, summed over the residents
        # Residents that may have a full block without a host copy (a superset: a stream joins
        # when a step fills one of its blocks and leaves once write-through has caught up).
        self.write_candidates: dict[str, Request] = {}
        # Residents that may not be decoding yet (a superset: a stream joins when it enters the
        # device and leaves once it has sampled a token in a step that filled a block or ran a
        # prefill); every other resident with a token is decoding.
        self.maybe_prefilling: dict[str, Request] = {}

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.preempted)

    def add_waiting(self, request: Request) -> None:
        request.state = RequestState.WAITING
        bisect.insort(self.waiting, request, key=_arrival)

    def park(self, request: Request) -> None:
        """A waiting request that started on another engine (an imported stream) waits among
        the paused instead, to resume by recompute."""
        self.waiting.remove(request)
        request.state = RequestState.PREEMPTED
        bisect.insort(self.preempted, request, key=_arrival)

    def enter_device(self, request: Request, state: RequestState) -> None:
        """A waiting or paused request starts running, or loading (`state`)."""
        if request.state is RequestState.WAITING:
            self.waiting.remove(request)
        else:
            self.preempted.remove(request)
        request.state = state
        self.running.append(request)
        self.remaining_output_tokens += request.num_remaining_output_tokens
        self.maybe_prefilling[request.request_id] = request
        if state is RequestState.LOADING:
            self.loading.append(request)

    def load_finished(self, request: Request) -> None:
        """A loading request's KV is all on the device: it runs from the next step."""
        request.state = RequestState.RUNNING
        self.loading.remove(request)

    def pause(self, request: Request) -> None:
        """A resident request goes off the device."""
        self._leave_device(request)
        request.state = RequestState.PREEMPTED
        bisect.insort(self.preempted, request, key=_arrival)

    def remove(self, request: Request) -> None:
        """A request ends, from whichever queue holds it (its state is then set by the caller)."""
        if request.state is RequestState.WAITING:
            self.waiting.remove(request)
        elif request.state is RequestState.PREEMPTED:
            self.preempted.remove(request)
        else:
            self._leave_device(request)

    def block_filled(self, request: Request) -> None:
        """A step filled one of a resident's blocks: it has KV to write through."""
        self.write_candidates[request.request_id] = request

    def token_appended(self, request: Request) -> None:
        """A resident sampled a token in a step that filled one of its blocks or ran a prefill
        (call after `Request.append_token`): it is decoding now."""
        self.maybe_prefilling.pop(request.request_id, None)

    def _leave_device(self, request: Request) -> None:
        self.running.remove(request)
        self.remaining_output_tokens -= request.num_remaining_output_tokens
        if request.state is RequestState.LOADING:
            self.loading.remove(request)
        self.write_candidates.pop(request.request_id, None)
        self.maybe_prefilling.pop(request.request_id, None)
