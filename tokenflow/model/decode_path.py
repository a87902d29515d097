"""Which decode-only steps run through compiled graphs: measured on the machine at start, cached.

`compiled_decode.CompiledDecoder` fuses each layer's small ops into one compiled call.  At a few
streams those ops cost as much as the 4-bit matrix multiplies, so compiling them pays there;
whether it pays at 8 or 32 streams, where the multiplies dominate, depends on the CPU and on
what else runs on it.  So, like the kernel plan, the engine times both paths on the loaded
model and its KV cache at the decode sizes of the kernel probe (DECODE_ROWS: 1, 8, 32 streams),
interleaved A B B A, and keeps the compiled one up to the largest size at which it won at every
size up to there.  The choice is cached on disk per machine, model file and kernel plan, so a
later start only warms the compiler up (seconds, from its own cache) or skips it.

A whole decode step as one graph (all layers, the KV write and the paged attention inside) was
measured too: inductor took 97 s to compile it on this project's 2-core CPU, and the graph's
KV writes into the one shared cache tensor made a step seconds long; the per-layer calls stay.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tokenflow.model.kernels import (
    DECODE_ROWS,
    KernelCache,
    KernelPlan,
    default_cache_dir,
    machine_key,
)
from tokenflow.model.kernels.cache import model_file_key, write_record

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
# Compiled must beat eager by this factor at a size to be kept there: a tie keeps the path
# that needs no compiler at the next start.
WIN_FACTOR = 0.97
# Each path is timed over this many decode steps per round, in rounds A B B A.
STEPS_PER_ROUND = 4
NUM_ROUNDS = 2
# `compiled_max_rows` of a choice that compiles every decode step (`--compile-decode`).
ALL_ROWS = 1 << 30


@dataclass(frozen=True)
class DecodePathTiming:
    """Seconds per decode step of `rows` streams, eagerly and through compiled graphs (each the
    best of its rounds)."""

    rows: int
    eager_s: float
    compiled_s: float


@dataclass(frozen=True)
class DecodePathChoice:
    """Decode-only steps of up to `compiled_max_rows` streams run compiled (0: none)."""

    compiled_max_rows: int
    source: str  # "probe", "cache" or "flags"
    timings: tuple[DecodePathTiming, ...] = ()

    def uses_compiled(self, rows: int) -> bool:
        return rows <= self.compiled_max_rows

    def describe(self) -> str:
        """The start-up log line: the choice, then each size's eager and compiled step."""
        what = f"compiled up to {self.compiled_max_rows} streams"
        if self.compiled_max_rows in (0, ALL_ROWS):
            what = "compiled" if self.compiled_max_rows else "eager"
        text = f"decode steps ({self.source}): {what}"
        if self.timings:
            cells = ", ".join(
                f"{t.rows} streams {t.eager_s * 1e3:.2f} ms eager / "
                f"{t.compiled_s * 1e3:.2f} ms compiled"
                for t in self.timings
            )
            text += f"; measured: {cells}"
        return text


def compiled_max_rows(timings: Sequence[DecodePathTiming]) -> int:
    """The largest measured size up to which compiled won (by WIN_FACTOR) at every size."""
    limit = 0
    for timing in sorted(timings, key=lambda t: t.rows):
        if timing.compiled_s > WIN_FACTOR * timing.eager_s:
            break
        limit = timing.rows
    return limit


StepRunner = Callable[[int, bool], None]  # (rows, compiled) -> runs one decode step


def measure_decode_paths(
    run_step: StepRunner, sizes: Sequence[int] = DECODE_ROWS
) -> tuple[DecodePathTiming, ...]:
    """Time both paths at each size: one warm-up step each, then NUM_ROUNDS rounds A B B A of
    STEPS_PER_ROUND steps, the best round of each path (other work only slows a round)."""
    timings = []
    for rows in sizes:
        best = {False: math.inf, True: math.inf}
        for compiled in (False, True):
            run_step(rows, compiled)
        for round_index in range(NUM_ROUNDS):
            order = (False, True) if round_index % 2 == 0 else (True, False)
            for compiled in order:
                started = time.perf_counter()
                for _ in range(STEPS_PER_ROUND):
                    run_step(rows, compiled)
                took = (time.perf_counter() - started) / STEPS_PER_ROUND
                best[compiled] = min(best[compiled], took)
        timings.append(DecodePathTiming(rows, best[False], best[True]))
    return tuple(timings)


@dataclass
class DecodePathCache:
    """Decode-path choices on disk, one JSON file per key, beside the kernel choices."""

    directory: Path = field(default_factory=lambda: default_cache_dir() / "decode")

    def load(self, key: dict[str, object]) -> DecodePathChoice | None:
        """The choice stored for exactly `key`, or None (absent, another key, unreadable)."""
        try:
            data = json.loads(self._path(key).read_text(encoding="utf-8"))
            if data.get("version") != CACHE_VERSION or data.get("key") != key:
                return None
            timings = tuple(DecodePathTiming(**t) for t in data["choice"]["timings"])
            return DecodePathChoice(compiled_max_rows(timings), "cache", timings)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def store(self, key: dict[str, object], choice: DecodePathChoice) -> bool:
        """Write the choice; whether it was written (a failure is only logged)."""
        record = {
            "version": CACHE_VERSION,
            "key": key,
            "choice": {"timings": [asdict(t) for t in choice.timings]},
        }
        return write_record(self._path(key), record)

    def _path(self, key: dict[str, object]) -> Path:
        return KernelCache(self.directory).path_for(key)


def decode_path_key(
    model_path: Path, plan: KernelPlan, threads: int, serial_below_tokens: int
) -> dict[str, object]:
    """What the measurement depends on: the machine (as for the kernel plan), the model file
    and the kernel plan it runs."""
    return {
        **machine_key(threads, serial_below_tokens),
        **model_file_key(model_path),
        "plan": asdict(plan),
    }


@dataclass(frozen=True)
class DecodePathSettings:
    """How the executor decides its decode path when no flag forces one."""

    key: dict[str, object]  # decode_path_key of the loaded model
    use_cache: bool = True  # False: measure anew and do not store (`--no-kernel-cache`)
    cache: DecodePathCache | None = None  # None: the user cache dir


def choose_decode_path(
    settings: DecodePathSettings, prepare: Callable[[], StepRunner | None]
) -> DecodePathChoice:
    """From the cache, else measured with the runner `prepare` returns (it compiles; None:
    compiling failed, so eager, not stored) and cached."""
    cache = settings.cache or DecodePathCache()
    if settings.use_cache:
        cached = cache.load(settings.key)
        if cached is not None:
            return cached
    logger.info("decode steps: timing eager against compiled steps (once per machine and model)")
    run_step = prepare()
    if run_step is None:
        return DecodePathChoice(0, "flags")
    timings = measure_decode_paths(run_step)
    choice = DecodePathChoice(compiled_max_rows(timings), "probe", timings)
    if settings.use_cache:
        cache.store(settings.key, choice)
    return choice
