"""Compiling structured outputs' grammars where no other request waits for it: worker
processes, a deadline, and bounds checked first.

A JSON Schema of 63 bytes can take xgrammar minutes of CPU and hundreds of MB to compile
(`schema_limits.py` has the figures).  So a compile never runs on the server's event loop or
the engine thread:

- the schema is checked against `schema_limits` first (SchemaTooComplex, at once);
- a compiled grammar is looked up in a cache bounded in bytes (equal schemas compile once);
- otherwise one of `num_workers` worker processes compiles it, and the caller (a thread: the
  server awaits it off its loop) waits at most `timeout_s`.  A compile past its deadline has its
  process killed (a thread could not be stopped, and would hold a core and its memory until
  xgrammar returned) and a fresh one takes its place; the request gets GrammarError naming the
  deadline.  A caller that finds every worker busy past the deadline gets CompilerBusy.

The worker returns the grammar serialized (xgrammar's JSON, about 0.5 MB and 10 ms each way for
a typical schema); a grammar larger than MAX_GRAMMAR_BYTES is refused rather than cached.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

import xgrammar

from tokenflow.core.request import StructuredOutput
from tokenflow.model.schema_limits import (
    GrammarError,
    SchemaTooComplex,
    check_grammar,
    check_regex,
    check_schema,
    shortened,
)

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_BYTES = 64 << 20  # compiled grammars kept for reuse
MAX_GRAMMAR_BYTES = 16 << 20  # one compiled grammar (a 20,000-value enum makes 83 MB)
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_NUM_WORKERS = 1
# xgrammar's errors start with "[time] file.cc:line: ", and assertions with "Check failed: (...)
# is false:"; the rest is the message for the client.
_LOCATION_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"^Check failed:.*?is false:\s*")


class CompilerBusy(RuntimeError):
    """Every compile worker stayed busy past the deadline (the request may be retried)."""


CompileFn = Callable[[str], str]  # schema text -> serialized grammar (raises GrammarError)

# Each kind of constraint: the bounds checked before it compiles, and its name in errors.
_CHECKS: dict[str, Callable[[str, str], None]] = {
    "json_schema": check_schema,
    "regex": check_regex,
    "grammar": check_grammar,
}
_NOUNS = {"json_schema": "JSON schema", "regex": "regular expression", "grammar": "grammar"}


class GrammarCompiler:
    """Compiles JSON Schemas for one tokenizer, in worker processes, with a cache.

    `compile()` blocks its calling thread (at most about twice `timeout_s`: a wait for a worker,
    then the compile); call it from a worker thread where a loop must go on.  Thread-safe.
    """

    def __init__(
        self,
        tokenizer_info: xgrammar.TokenizerInfo,
        *,
        num_workers: int = DEFAULT_NUM_WORKERS,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        make_worker: Callable[[str], CompileWorker] | None = None,
    ) -> None:
        if num_workers < 1 or not timeout_s > 0:
            raise ValueError("a grammar compiler needs >= 1 worker and a timeout > 0")
        self.tokenizer_info = tokenizer_info
        self.timeout_s = timeout_s
        info_json = tokenizer_info.serialize_json()
        make = make_worker or ProcessWorker
        self._idle: queue.SimpleQueue[CompileWorker] = queue.SimpleQueue()
        for _ in range(num_workers):
            self._idle.put(make(info_json))
        self._cache: OrderedDict[tuple[str, str], xgrammar.CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> xgrammar.CompiledGrammar:
        """`spec`'s compiled grammar: SchemaTooComplex (a ValueError) over a bound,
        GrammarError when it cannot be compiled or its compile passes the deadline,
        CompilerBusy when no worker was free in time."""
        key = (spec.kind, spec.json_schema)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        _CHECKS[spec.kind](spec.json_schema, spec.origin)
        serialized = self._in_worker(spec)
        grammar = xgrammar.CompiledGrammar.deserialize_json(serialized, self.tokenizer_info)
        size = grammar.memory_size_bytes
        if size > MAX_GRAMMAR_BYTES:
            raise GrammarError(
                f"{spec.origin}: the schema's grammar takes {size >> 20} MiB; at most "
                f"{MAX_GRAMMAR_BYTES >> 20} MiB are accepted (fewer enum values or properties)"
            )
        self._remember(key, grammar, size)
        return grammar

    def close(self) -> None:
        """Stop the workers (a compile in flight is killed)."""
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return

    def _in_worker(self, spec: StructuredOutput) -> str:
        started = time.monotonic()
        try:
            worker = self._idle.get(timeout=self.timeout_s)
        except queue.Empty:
            raise CompilerBusy(
                f"every grammar compiler was busy for {self.timeout_s:g} s; retry later"
            ) from None
        try:
            left = max(self.timeout_s - (time.monotonic() - started), self.timeout_s / 2)
            return worker.compile(spec.json_schema, left, spec.origin, spec.kind)
        finally:
            self._idle.put(worker)

    def _remember(self, key: tuple[str, str], grammar: xgrammar.CompiledGrammar, size: int) -> None:
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = grammar
            self._cache_bytes += size
            while self._cache_bytes > GRAMMAR_CACHE_BYTES and len(self._cache) > 1:
                _, evicted = self._cache.popitem(last=False)
                self._cache_bytes -= evicted.memory_size_bytes


class CompileWorker(Protocol):
    """What `GrammarCompiler` needs of a worker (a process here; a stub in tests)."""

    def compile(
        self, schema_text: str, timeout_s: float, origin: str, kind: str = "json_schema"
    ) -> str:
        """The serialized grammar of `schema_text` (a `StructuredOutput.kind`); GrammarError
        if it cannot be compiled in `timeout_s`."""
        ...

    def close(self) -> None:
        """Stop the worker (a compile in flight is abandoned)."""
        ...


class ProcessWorker:
    """One compile process, started on first use and killed (then restarted on the next use)
    when a compile passes its deadline."""

    def __init__(
        self, tokenizer_info_json: str, serve: Callable[[Connection, str], None] | None = None
    ) -> None:
        self._info_json = tokenizer_info_json
        self._serve = serve or serve_compiles  # the process's loop (a module-level function)
        self._process: Any = None
        self._conn: Connection | None = None

    def compile(
        self, schema_text: str, timeout_s: float, origin: str, kind: str = "json_schema"
    ) -> str:
        conn = self._started()
        conn.send((kind, schema_text))
        if not conn.poll(timeout_s):
            logger.warning("a grammar compile passed its %.1f s deadline; worker killed", timeout_s)
            self.close()
            raise GrammarError(
                f"{origin}: the schema did not compile within {timeout_s:g} s (the server's "
                "--grammar-compile-timeout-s); simplify it"
            )
        ok, payload = conn.recv()
        if not ok:
            raise GrammarError(f"{origin}: the {_NOUNS[kind]} cannot be compiled: {payload}")
        return payload

    @property
    def pid(self) -> int | None:
        """The compile process's id (None before its first compile or after a kill)."""
        return None if self._process is None else self._process.pid

    def close(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None

    def _started(self) -> Connection:
        if self._process is None or not self._process.is_alive():
            self.close()
            context = multiprocessing.get_context("spawn")  # (no fork of a threaded server)
            ours, theirs = context.Pipe()
            self._process = context.Process(
                target=self._serve, args=(theirs, self._info_json), daemon=True
            )
            self._process.start()
            theirs.close()
            self._conn = ours
        assert self._conn is not None
        return self._conn


def serve_compiles(conn: Connection, tokenizer_info_json: str) -> None:
    """A worker process's loop: (kind, text) in, (True, serialized grammar) or (False, the
    compiler's message) out, until the pipe closes."""
    info = xgrammar.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    while True:
        try:
            kind, text = conn.recv()
        except EOFError:
            return
        try:
            grammar = _compiled(compiler, kind, text)
            conn.send((True, grammar.serialize_json()))
        except (RuntimeError, ValueError, TypeError) as err:
            conn.send((False, compiler_message(err)))


def _compiled(compiler: xgrammar.GrammarCompiler, kind: str, text: str) -> xgrammar.CompiledGrammar:
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "grammar":
        return compiler.compile_grammar(text)
    return compiler.compile_json_schema(text, any_whitespace=False)


def compiler_message(err: BaseException) -> str:
    """xgrammar's error as one line for a client: its first line without the "[time]
    file.cc:line:" location or a "Check failed: (...) is false:" assertion, cut to 200
    characters (a message may quote the client's input)."""
    text = str(err).strip()
    line = text.splitlines()[0] if text else ""
    line = _CHECK_FAILED.sub("", _LOCATION_PREFIX.sub("", line)).strip() or "invalid schema"
    return shortened(line)


__all__ = [
    "CompilerBusy",
    "GrammarCompiler",
    "GrammarError",
    "SchemaTooComplex",
    "compiler_message",
]
