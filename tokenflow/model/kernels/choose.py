"""The one entry point: the plan for this model on this machine, from the cache or probed."""

from __future__ import annotations

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
    Measure,
    ModelShapes,
    candidate_plans,
    choose_plan,
    probe_kernels,
)
from tokenflow.model.kv_cache import available_memory_bytes


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
    if settings.use_cache:
        cached = cache.load(key)
        if cached is not None and cached.plan in candidates:
            return cached
    serial = settings.serial_below_tokens

    def threads_for_rows(rows: int) -> int:
        return 1 if rows < serial else threads

    started = time.perf_counter()
    measure = measure or TorchMeasure(shapes, threads_for_rows)
    layer_kernels = list(dtypes)
    if has_int4:
        layer_kernels += [INT4 if d == BFLOAT16 else INT4_FROM_FP32 for d in dtypes]
    head_kernels = [d for d in (FLOAT32, BFLOAT16) if d in dtypes]
    timings = probe_kernels(measure, layer_kernels, head_kernels)
    if memory_bytes is None:
        memory_bytes = available_memory_bytes(torch.device("cpu"))
    plan, costs = choose_plan(timings, candidates, shapes, memory_bytes)
    choice = KernelChoice(plan, "probe", costs, time.perf_counter() - started)
    if settings.use_cache:
        cache.store(key, choice)
    return choice
