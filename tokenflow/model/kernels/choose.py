"""The one entry point: the plan for this model on this machine, from the cache or probed."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenflow.model.kernels.cache import KernelCache, machine_key, model_key
from tokenflow.model.kernels.measure import TorchMeasure
from tokenflow.model.kernels.plan import (
    BFLOAT16,
    FLOAT32,
    INT4,
    INT4_FROM_FP32,
    KernelChoice,
    KernelPlan,
    KernelTiming,
    Measure,
    ModelShapes,
    candidate_plans,
    choose_plan,
    probe_kernels,
    probe_sizes,
)
from tokenflow.model.kv_cache import available_memory_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProbeSettings:
    """How an automatic choice is made: the engine's single-thread rule, and the cache."""

    serial_below_tokens: int = 0  # steps of fewer tokens run on one thread (engine/threads.py)
    use_cache: bool = True  # False: probe anew and do not store (`--no-kernel-cache`)
    cache: KernelCache | None = None  # None: the user cache dir


def choose_kernels(
    shapes: ModelShapes,
    model_path: Path,
    dtypes: Sequence[str],
    has_int4: bool,
    settings: ProbeSettings,
    measure: Measure | None = None,
    memory_bytes: int | None = None,
) -> KernelChoice:
    """The plan for this model on this machine: from the cache, else probed (and cached).

    `measure` (default: TorchMeasure on the model's shapes) and `memory_bytes` (default: the
    host's available memory) are parameters so the rule can be tested without timing anything.
    The probe takes tens of seconds on a first start: it says so at INFO, one line per size it
    times, and where its choice is cached.
    """
    candidates = candidate_plans(dtypes, has_int4)
    if len(candidates) == 1:
        return KernelChoice(candidates[0], "checkpoint")
    threads = torch.get_num_threads()
    key = {
        **machine_key(threads, settings.serial_below_tokens),
        **model_key(model_path, dtypes, has_int4),
    }
    cache = settings.cache or KernelCache()
    path = cache.path_for(key)
    if settings.use_cache:
        cached = cache.load(key)
        if cached is not None and cached.plan in candidates:
            logger.info(
                "kernels: using the choice probed on an earlier start, cached in %s "
                "(--no-kernel-cache probes again)",
                path,
            )
            return cached
    kept = f"stored in {path}" if settings.use_cache else "not stored: --no-kernel-cache"
    logger.info(
        "kernel probe: timing this model's kernels to pick the fastest, once per machine and "
        "model (the choice is %s)",
        kept,
    )
    choice = _probe(shapes, candidates, dtypes, has_int4, settings, threads, measure, memory_bytes)
    stored = settings.use_cache and cache.store(key, choice)
    logger.info(
        "kernel probe: done in %.1f s%s", choice.probe_s, f", wrote {path}" if stored else ""
    )
    return choice


def _probe(
    shapes: ModelShapes,
    candidates: Sequence[KernelPlan],
    dtypes: Sequence[str],
    has_int4: bool,
    settings: ProbeSettings,
    threads: int,
    measure: Measure | None,
    memory_bytes: int | None,
) -> KernelChoice:
    """Time every kernel the model may take (`probe_kernels`) and choose among `candidates`."""
    serial = settings.serial_below_tokens

    def threads_for_rows(rows: int) -> int:
        return 1 if rows < serial else threads

    started = time.perf_counter()
    measure = measure or TorchMeasure(shapes, threads_for_rows)
    layer_kernels = list(dtypes)
    if has_int4:
        layer_kernels += [INT4 if d == BFLOAT16 else INT4_FROM_FP32 for d in dtypes]
    head_kernels = [d for d in (FLOAT32, BFLOAT16) if d in dtypes]
    progress = _ProbeProgress(probe_sizes(layer_kernels, head_kernels))
    timings = probe_kernels(measure, layer_kernels, head_kernels, progress)
    if memory_bytes is None:
        memory_bytes = available_memory_bytes(torch.device("cpu"))
    plan, costs = choose_plan(timings, candidates, shapes, memory_bytes)
    return KernelChoice(plan, "probe", costs, time.perf_counter() - started)


class _ProbeProgress:
    """Logs each size the probe timed: 'kernel probe 3/8: layers at 32 rows: float32 ...'."""

    def __init__(self, num_sizes: int) -> None:
        self._num_sizes = num_sizes
        self._num_done = 0

    def __call__(self, timings: Sequence[KernelTiming]) -> None:
        self._num_done += 1
        cells = ", ".join(f"{t.kernel} {t.seconds * 1e3:.2f} ms" for t in timings)
        part, rows = timings[0].part, timings[0].rows
        logger.info(
            "kernel probe %d/%d: %s at %d rows: %s",
            self._num_done,
            self._num_sizes,
            part,
            rows,
            cells,
        )
