"""The serving engine: an `LLMEngine` stepped by a background thread, behind `EngineClient`.

Requests and aborts go to the thread through a command queue; deltas come back to each
request's asyncio queue via `loop.call_soon_threadsafe`.  If a step raises, every live request
receives that error (never a silent hang) and the engine keeps serving new requests.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from tokenflow.core.request import SamplingParams
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.engine.llm_engine import LLMEngine
from tokenflow.serving.engine_client import (
    EngineOverloaded,
    EngineRequestError,
    EngineStats,
    GenerationDelta,
)

_IDLE_WAIT_S = 0.05  # how long the thread blocks on its queue when there is nothing to run
_NOTHING_RAN_WAIT_S = 0.002  # pause after a step in which nothing could run


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    rate_tps: float
    sink: asyncio.Queue[GenerationDelta | BaseException]
    loop: asyncio.AbstractEventLoop


@dataclass(frozen=True)
class _Abort:
    request_id: str


class AsyncEngine:
    """`EngineClient` over a real engine; one thread owns all engine state.

    By default that is a background thread started here.  `tokenflow serve` passes
    `start_thread=False` and calls `run_loop()` from the main thread instead (with the HTTP
    server in a background thread): torch's OpenMP workers spin-wait only for the main thread's
    parallel regions, and a step loop in another thread measured about half as fast on CPU.
    """

    def __init__(self, args: EngineArgs, start_thread: bool = True) -> None:
        self.engine = LLMEngine(args)
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self.default_rate_tps = args.default_rate_tps
        self.tokenizer = self.engine.tokenizer
        self._max_waiting = args.max_waiting
        self._commands: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._sinks: dict[str, _Add] = {}
        self._num_pending_adds = 0
        self._lock = threading.Lock()
        self._stats = self.engine.stats()
        self._thread: threading.Thread | None = None
        if start_thread:
            self._thread = threading.Thread(
                target=self.run_loop, name="tokenflow-engine", daemon=True
            )
            self._thread.start()

    # -- EngineClient ------------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        rate_tps: float,
    ) -> AsyncIterator[GenerationDelta]:
        """Submit and stream deltas; raises before the first delta if refused."""
        prompt = list(prompt_token_ids)
        try:
            self.engine.validate(prompt, sampling_params)
        except ValueError as err:
            raise EngineRequestError(str(err)) from None
        with self._lock:
            if self._stats.num_waiting + self._num_pending_adds >= self._max_waiting:
                raise EngineOverloaded(
                    f"{self._max_waiting} requests are already waiting", retry_after_s=1.0
                )
            self._num_pending_adds += 1
        sink: asyncio.Queue[GenerationDelta | BaseException] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._commands.put(_Add(request_id, prompt, sampling_params, rate_tps, sink, loop))
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        """Cancel a request; a no-op if it already ended."""
        self._commands.put(_Abort(request_id))

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step."""
        return self._stats

    def close(self) -> None:
        """Stop the engine loop (requests still running get an error)."""
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.engine.close()

    def stop(self) -> None:
        """Ask `run_loop()` to return (from any thread)."""
        self._commands.put(None)

    # -- the engine loop -------------------------------------------------------------------------
    def run_loop(self) -> None:
        """Step the engine until `stop()` or `close()`; owns all engine state meanwhile."""
        while True:
            wait = self.engine.has_work is False
            if not self._drain(block=wait):
                break
            if not self.engine.has_work:
                continue
            try:
                ran, deltas = self.engine.step()
            except Exception as err:  # noqa: BLE001 - delivered to every live request
                self._fail_all(RuntimeError(f"engine step failed: {err}"))
                continue
            for delta in deltas:
                self._deliver(delta)
            self._stats = self.engine.stats()
            if not ran:
                threading.Event().wait(_NOTHING_RAN_WAIT_S)
        self._fail_all(RuntimeError("the engine was shut down"))

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; False when asked to stop."""
        try:
            command = (
                self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            return True
        while True:
            if command is None:
                return False
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            delta = self.engine.abort(command.request_id)
            if delta is not None:
                self._deliver(delta)
                self._stats = self.engine.stats()
            return
        with self._lock:
            self._num_pending_adds -= 1
        try:
            self.engine.add_request(
                command.request_id, command.prompt_token_ids, command.params, command.rate_tps
            )
        except ValueError as err:
            command.loop.call_soon_threadsafe(command.sink.put_nowait, EngineRequestError(str(err)))
            return
        self._sinks[command.request_id] = command
        self._stats = self.engine.stats()

    def _deliver(self, delta: GenerationDelta) -> None:
        add = self._sinks.get(delta.request_id)
        if add is None:
            return
        if delta.finish_reason is not None:
            del self._sinks[delta.request_id]
        add.loop.call_soon_threadsafe(add.sink.put_nowait, delta)

    def _fail_all(self, error: Exception) -> None:
        for request_id, add in list(self._sinks.items()):
            self.engine.abort(request_id)
            add.loop.call_soon_threadsafe(add.sink.put_nowait, error)
        self._sinks.clear()
