"""The serving engine: an `LLMEngine` stepped by one thread, behind `EngineClient`.

Requests, aborts, snapshot requests (`streams()`), streams moving in and out (`resume()`,
`export_streams()`) and readings of engine state (`replica_load()`, `between_steps()`) go to the
thread through a command queue (the commands and their answer channels are commands.py),
applied between two steps; deltas, snapshots, exported states and readings come back to each
asker via `loop.call_soon_threadsafe` (deltas through the request's `DeltaSink`) or a
thread-safe future.  What it serves with (`description`) is fixed once built: any thread reads
it.  What can go wrong, and who hears of it:

- one request fails (its sampling row, its text, its add): only that request gets an error;
- a step's plan fails: only the plan's requests get an error (see `LLMEngine.step`);
- the scheduler fails with no plan to blame: every live request gets an error and the loop goes
  on; after `_MAX_UNATTRIBUTED_FAILURES` such steps in a row the engine is declared dead;
- the loop dies (any other exception) or shuts down: every live and queued request gets
  `EngineDead` at once, every later `generate()` raises it, and `health()` reports it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from concurrent.futures import Future
from typing import TypeVar

import anyio

from tokenflow.core.engine_core import NOTHING_RAN_WAIT_S
from tokenflow.core.load_report import LoadReport
from tokenflow.core.migration import StreamExport
from tokenflow.core.rebalance import ReplicaLoad
from tokenflow.core.request import Consumption, Request, SamplingParams
from tokenflow.engine.build import ExecutorFactory, build_torch_executor
from tokenflow.engine.client import (
    EngineDead,
    EngineHealth,
    EngineOverloaded,
    EngineRequestError,
    EngineStats,
    GenerationDelta,
    RequestFailed,
    StreamMoved,
)
from tokenflow.engine.commands import (
    AbortRequest,
    AddRequest,
    CallEngine,
    Command,
    DeltaSink,
    ImportStream,
    SnapshotStreams,
    Submission,
    send,
    settle,
)
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.engine.llm_engine import LLMEngine
from tokenflow.engine.readings import Landings, describe, measure_load, measure_replica_load
from tokenflow.engine.snapshot import StreamsSnapshot
from tokenflow.model.grammar import CompiledGrammar
from tokenflow.model.grammar_compile import CompilerBusy

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05  # how long the thread blocks on its queue when there is nothing to run
_MAX_UNATTRIBUTED_FAILURES = 3  # scheduler failures in a row before the engine is dead
_T = TypeVar("_T")


class AsyncEngine:
    """`EngineClient` over a real engine; one thread owns all engine state.

    By default that is a background thread started here.  `tokenflow serve` passes
    `start_thread=False` and calls `run_loop()` from the main thread instead (with the HTTP
    server in a background thread): torch's OpenMP workers spin-wait only for the main thread's
    parallel regions, and a step loop in another thread measured about half as fast on CPU.
    """

    def __init__(
        self,
        args: EngineArgs,
        start_thread: bool = True,
        build_executor: ExecutorFactory = build_torch_executor,
    ) -> None:
        self.engine = LLMEngine(args, build_executor)
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self.kernels = self.engine.kernels
        self.vocab_size = self.engine.model_config.vocab_size
        self.default_rate_tps = args.default_rate_tps
        self.tokenizer = self.engine.tokenizer
        self.max_num_requests = args.max_num_requests
        self.description = describe(self.engine)  # (frozen: any thread may read it)
        # SimpleQueue: its put() is reentrant, so stop() is safe from a signal handler that
        # interrupts this thread inside get() (a Queue's lock would deadlock there).
        self._commands: queue.SimpleQueue[Command | None] = queue.SimpleQueue()
        self._sinks: dict[str, Submission] = {}
        self._num_pending_adds = 0
        self._lock = threading.Lock()  # guards _num_pending_adds, _death and queueing adds
        self._death: str | None = None
        self._last_tick_s = time.monotonic()
        self._stats = self.engine.stats()
        self._thread: threading.Thread | None = None
        # Called on the engine thread after every step (e.g. a replica's load report,
        # tokenflow/replicas): it may read engine state, which no other thread may.
        self.after_step: Callable[[], None] | None = None
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
        consumption: Consumption = Consumption.READER,
        *,
        session_key: str | None = None,
    ) -> AsyncIterator[GenerationDelta]:
        """Submit and stream deltas; raises before the first delta if refused."""
        prompt = list(prompt_token_ids)
        try:
            self.engine.validate(prompt, sampling_params)
        except ValueError as err:
            raise EngineRequestError(str(err)) from None
        grammar = await self._compiled(sampling_params)
        sink, loop = DeltaSink(), asyncio.get_running_loop()
        add = AddRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=sampling_params,
            rate_tps=rate_tps,
            consumption=consumption,
            sink=sink,
            loop=loop,
            grammar=grammar,
            session_key=session_key,
        )
        self._submit(add)
        async for delta in self._deltas(request_id, sink):
            yield delta

    async def resume(self, state: StreamExport) -> AsyncIterator[GenerationDelta]:
        """Go on with a stream another engine exported (`StreamMoved.state`): it resumes by
        recompute when the policy starts it, and its deltas hold only the tokens and text after
        those produced there (`LLMEngine.import_stream`).  Refused as `generate()`."""
        try:
            self.engine.validate(list(state.prompt_token_ids), state.sampling_params)
        except ValueError as err:
            raise EngineRequestError(str(err)) from None
        grammar = await self._compiled(state.sampling_params)
        sink, loop = DeltaSink(), asyncio.get_running_loop()
        self._submit(ImportStream(state, sink, loop, grammar))
        async for delta in self._deltas(state.request_id, sink):
            yield delta

    async def compile_grammar(self, sampling_params: SamplingParams) -> None:
        """Compile (and cache) the request's structured-output grammar in a compile worker,
        off the event loop and the engine thread; refused as `generate()`."""
        await self._compiled(sampling_params)

    async def _compiled(self, params: SamplingParams) -> CompiledGrammar | None:
        """The request's compiled grammar (None without one), from a worker thread that waits
        on the compile process: EngineRequestError for a schema that cannot be compiled in
        time, EngineOverloaded when every compile worker stayed busy."""
        if params.structured_output is None:
            return None
        try:
            return await anyio.to_thread.run_sync(self.engine.compile_grammar, params)
        except CompilerBusy as err:
            raise EngineOverloaded(str(err), retry_after_s=1.0) from None
        except ValueError as err:
            raise EngineRequestError(str(err)) from None

    def export_streams(
        self, request_ids: Sequence[str], only_if: Callable[[Request], bool] | None = None
    ) -> Future[list[StreamExport]]:
        """Take the unfinished requests among `request_ids` (`only_if`: those for which it
        holds then, e.g. still not started, or still paused) out of this engine before its next
        step (queued by the time this returns); the future holds their states (times relative
        to the export).  Each one's delta iterator then raises `StreamMoved` after the deltas
        produced before.  A request that finished meanwhile, or that the engine refuses to
        export, is left as it is.  A future, not a coroutine: a replica's drain thread, which
        has no event loop, waits on it."""
        ids = tuple(request_ids)
        return self.between_steps(lambda _: self._export(ids, only_if))

    def between_steps(self, fn: Callable[[LLMEngine], _T]) -> Future[_T]:
        """Call `fn(engine)` on the engine thread before its next step (or at once while it
        idles): the one safe way for another thread to read engine state.  The future holds
        what it returns, or what it raised.  The step waits for it: keep it quick."""
        future: Future[_T] = Future()
        with self._lock:  # (a command queued before the loop died is answered by `_die`)
            if self._death is not None:
                raise EngineDead(self._death)
            self._commands.put(CallEngine(fn, future))
        return future

    def load_report(self) -> LoadReport:
        """This engine's load as the fleet's router reads it (core/load_report.py), now.  It reads
        engine state: call it on the engine thread (in `after_step`), or before any request
        reached the engine."""
        return measure_load(self.engine.scheduler, self.engine.core.clock.now())

    def replica_load(
        self, replica_id: str, movable_ids: Collection[str], reached_s: Landings
    ) -> Future[ReplicaLoad]:
        """This replica's load and its queued requests and paused streams among `movable_ids`
        (core/rebalance.py), taken between two steps as `between_steps` takes it; `reached_s`
        (called there) gives when each request that moved here reached this engine."""
        ids = frozenset(movable_ids)
        return self.between_steps(
            lambda llm: measure_replica_load(
                llm.scheduler, llm.core.clock.now(), replica_id, ids, reached_s
            )
        )

    def _submit(self, command: Submission) -> None:
        """Queue a request for the engine thread, unless the engine is dead or full."""
        with self._lock:
            if self._death is not None:
                raise EngineDead(self._death)
            stats = self._stats
            unfinished = stats.num_waiting + stats.num_running + stats.num_preempted
            if unfinished + self._num_pending_adds >= self.max_num_requests:
                raise EngineOverloaded(
                    f"{self.max_num_requests} requests are already in the engine",
                    retry_after_s=1.0,
                )
            self._num_pending_adds += 1
            self._commands.put(command)

    async def _deltas(self, request_id: str, sink: DeltaSink) -> AsyncIterator[GenerationDelta]:
        """A submitted request's deltas until its finish; aborts it if the caller stops early."""
        finished = False
        try:
            while True:
                try:
                    item = await sink.get()
                except StreamMoved:
                    finished = True  # (this engine forgot it already)
                    raise
                if item.finish_reason == "error":
                    finished = True
                    raise RequestFailed(item.error or "the request failed")
                yield item
                if item.finish_reason is not None:
                    finished = True
                    return
        finally:
            if not finished:
                self._commands.put(AbortRequest(request_id))

    async def abort(self, request_id: str) -> None:
        """Cancel a request; a no-op if it already ended."""
        self._commands.put(AbortRequest(request_id))

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step."""
        return self._stats

    async def streams(self, limit: int) -> StreamsSnapshot:
        """The unfinished streams (the `limit` most urgent) and the scheduler's state, taken by
        the engine thread between two steps: a step never waits for it, and no step pays for it
        while nobody asks."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[StreamsSnapshot] = loop.create_future()
        with self._lock:  # (a command queued before the loop died is answered by `_die`)
            if self._death is not None:
                raise EngineDead(self._death)
            self._commands.put(SnapshotStreams(limit=limit, future=future, loop=loop))
        return await future

    def health(self) -> EngineHealth:
        """Alive until the loop dies or shuts down; the age of its latest turn."""
        return EngineHealth(
            is_alive=self._death is None,
            seconds_since_tick=time.monotonic() - self._last_tick_s,
            error=self._death,
        )

    def close(self) -> None:
        """Stop the engine loop (requests still running get an error)."""
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.engine.close()

    def stop(self) -> None:
        """Ask `run_loop()` to return (from any thread, or a signal handler)."""
        self._commands.put(None)

    # -- the engine loop -------------------------------------------------------------------------
    def run_loop(self) -> None:
        """Step the engine until `stop()` or `close()`; owns all engine state meanwhile.

        Never leaves a request waiting: however it ends, every live and queued request gets an
        error, and later ones are refused.
        """
        reason = "the server is shutting down"
        try:
            self._loop()
        except BaseException as err:
            logger.critical("the engine loop died", exc_info=err)
            reason = f"the engine loop died: {type(err).__name__}: {err}"
            raise
        finally:
            self._die(reason)

    def _loop(self) -> None:
        num_unattributed = 0
        while True:
            self._last_tick_s = time.monotonic()
            if not self._drain(block=not self.engine.has_work):
                return
            if not self.engine.has_work:
                continue
            try:
                ran, deltas = self.engine.step()
            except Exception as err:  # noqa: BLE001 - no plan to blame: every live request
                num_unattributed += 1
                logger.exception("engine step failed (%d in a row)", num_unattributed)
                if num_unattributed >= _MAX_UNATTRIBUTED_FAILURES:
                    raise
                self._fail_all(RequestFailed(f"engine step failed: {err}"))
                continue
            num_unattributed = 0
            for delta in deltas:
                self._deliver(delta)
            self._stats = self.engine.stats()
            if self.after_step is not None:
                self.after_step()
            if not ran:
                threading.Event().wait(NOTHING_RAN_WAIT_S)

    def _die(self, reason: str) -> None:
        """Refuse new requests and fail every live and queued one with EngineDead."""
        with self._lock:
            self._death = reason
        error = EngineDead(reason)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, AddRequest | ImportStream):
                send(command, error)
            elif isinstance(command, SnapshotStreams):
                settle(command, error)
            elif isinstance(command, CallEngine):
                command.future.set_exception(error)
        self._fail_all(error)

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

    def _apply(self, command: Command) -> None:
        if isinstance(command, SnapshotStreams):
            try:
                settle(command, self.engine.streams(command.limit))
            except Exception as err:  # noqa: BLE001 - the asker hears of it; the loop goes on
                logger.exception("the streams snapshot failed")
                settle(command, err)
            return
        if isinstance(command, CallEngine):
            try:
                command.future.set_result(command.fn(self.engine))
            except Exception as err:  # noqa: BLE001 - its caller hears of it; the loop goes on
                command.future.set_exception(err)
            return
        if isinstance(command, AbortRequest):
            delta = self.engine.abort(command.request_id)
            if delta is not None:
                self._deliver(delta)
                self._stats = self.engine.stats()
            return
        with self._lock:
            self._num_pending_adds -= 1
        try:
            if isinstance(command, ImportStream):
                self.engine.import_stream(command.state, command.grammar)
            else:
                self.engine.add_request(
                    command.request_id,
                    command.prompt_token_ids,
                    command.params,
                    command.rate_tps,
                    command.consumption,
                    command.grammar,
                    session_key=command.session_key,
                )
        except ValueError as err:
            send(command, EngineRequestError(str(err)))
            return
        except Exception as err:  # noqa: BLE001 - this request alone could not be added
            logger.exception("request %s could not be added", command.request_id)
            send(command, RequestFailed(f"the engine could not add the request: {err}"))
            return
        self._sinks[command.request_id] = command
        self._stats = self.engine.stats()

    def _export(
        self, request_ids: Sequence[str], only_if: Callable[[Request], bool] | None
    ) -> list[StreamExport]:
        """Export each live request of `request_ids` (`only_if`: each for which it holds); its
        sink hears `StreamMoved` after the deltas already sent to it (the same thread sent
        them, in order)."""
        states = []
        for request_id in request_ids:
            submission = self._sinks.get(request_id)
            if submission is None:
                continue  # finished, failed or aborted meanwhile
            request = self.engine.scheduler.requests.get(request_id)
            if only_if is not None and (request is None or not only_if(request)):
                continue  # it started or resumed meanwhile: it stays
            try:
                state = self.engine.export_stream(request_id)
            except ValueError as err:  # (the engine refused it): it finishes here
                logger.info("request %s stays: %s", request_id, err)
                continue
            del self._sinks[request_id]
            send(submission, StreamMoved(state))
            states.append(state)
        self._stats = self.engine.stats()
        return states

    def _deliver(self, delta: GenerationDelta) -> None:
        add = self._sinks.get(delta.request_id)
        if add is None:
            return
        if delta.finish_reason is not None:
            del self._sinks[delta.request_id]
        send(add, delta)

    def _fail_all(self, error: BaseException) -> None:
        for request_id, add in list(self._sinks.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - the request is failed below either way
                logger.exception("aborting %s failed", request_id)
            send(add, error)
        self._sinks.clear()
