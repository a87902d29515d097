"""Kernel plans and the rule that picks one from the probe's timings (no torch needed but
for the dtype names of `explicit_plan`).  The package docstring says why and how."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

import torch

from tokenflow.model.config import ModelConfig

FLOAT32 = "float32"
BFLOAT16 = "bfloat16"
# Step sizes the probe times: decode batches of 1, 8 and 32 streams, prefill chunks of 64 and
# 256 tokens.  The largest stands for every larger input, so it always takes the dense kernel.
PROBE_ROWS = (1, 8, 32, 64, 256)
DECODE_ROWS = (1, 8, 32)
# A kernel this many times slower than the best at one size, and slow in itself (a step that
# long), is not timed at larger ones: its cost only grows with the rows, and emulated bf16 at
# 256 rows takes seconds on AVX2.  Cheap kernels are always timed, since which is fastest can
# flip with the size (a bf16 LM head leads at one row on AVX2 and trails from eight).
PRUNE_FACTOR = 4.0
PRUNE_ABOVE_S = 0.1
# A plan whose worst regime is within this factor of another's counts as equal; the smaller
# sum of every regime's ratio to its best, then the smaller footprint, decides.
EQUAL_FACTOR = 1.01
# Weights may take at most this share of the host's available memory.
MEMORY_SHARE = 0.8
# What the four kernels are called in the probe's records.
INT4 = "int4"  # packed 4-bit codes, bf16 activations
INT4_FROM_FP32 = "int4-from-float32"  # the same kernel inside a float32 model (casts around it)
# `--weights int4` given explicitly: the 4-bit kernel for inputs of up to this many rows.
EXPLICIT_INT4_MAX_ROWS = 16


@dataclass(frozen=True)
class KernelPlan:
    """Which kernel each matrix multiply takes, by its dtype and its input's rows."""

    dtype: str = FLOAT32  # activations and dense weights: "float32", "bfloat16" ("float16" CUDA)
    int4_max_rows: int = 0  # projections use the 4-bit kernel up to this many rows (0: never)
    head_bf16_max_rows: int = 0  # float32 model: the LM head in bf16 up to this many rows
    # The 4-bit kernel's activations: bf16 (its fast path; a float32 model casts around it) or
    # float32 (torch's exact reference kernel, slow: only when asked for with explicit flags).
    int4_dtype: str = BFLOAT16

    def __post_init__(self) -> None:
        if self.dtype not in (FLOAT32, BFLOAT16, "float16"):
            raise ValueError(f"kernel plan dtype {self.dtype!r} is not a float dtype")
        if self.int4_dtype not in (FLOAT32, BFLOAT16):
            raise ValueError(f"the 4-bit kernel runs in float32 or bfloat16, not {self.int4_dtype}")
        if self.int4_max_rows < 0 or self.head_bf16_max_rows < 0:
            raise ValueError("kernel plan row limits must be >= 0")
        if self.dtype == BFLOAT16 and self.head_bf16_max_rows:
            raise ValueError("a bfloat16 model's LM head is bfloat16 already")

    @property
    def uses_int4(self) -> bool:
        return self.int4_max_rows > 0

    def layer_kernel(self, rows: int) -> str:
        """The kernel the layers' projections take for an input of `rows` rows."""
        if rows <= self.int4_max_rows:
            return INT4 if self.dtype == self.int4_dtype else INT4_FROM_FP32
        return self.dtype

    def head_dtype(self, rows: int) -> str:
        """The dtype the LM head computes in for `rows` rows."""
        return BFLOAT16 if rows <= self.head_bf16_max_rows else self.dtype

    def describe(self) -> str:
        """One line: 'float32, 4-bit projections up to 8 rows, LM head bf16 up to 1 row'."""
        parts = [self.dtype]
        if self.uses_int4:
            parts.append(f"4-bit projections up to {self.int4_max_rows} rows")
        if self.head_bf16_max_rows:
            parts.append(f"LM head bfloat16 up to {self.head_bf16_max_rows} rows")
        return ", ".join(parts)


@dataclass(frozen=True)
class KernelTiming:
    """One probe measurement: all layers' projections (part "layers") or the LM head ("head")
    under `kernel` for an input of `rows` rows, best of its repeats."""

    part: str  # "layers" or "head"
    kernel: str  # INT4, INT4_FROM_FP32, FLOAT32 or BFLOAT16
    rows: int
    seconds: float


@dataclass(frozen=True)
class RegimeCost:
    """What a plan costs in one regime against the best any kernel achieves there."""

    rows: int
    chosen_s: float
    best_s: float


@dataclass(frozen=True)
class KernelChoice:
    """The plan the model runs and how it was reached (for the log, /v1/models, profiles)."""

    plan: KernelPlan
    source: str  # "probe", "cache", "flags" or "checkpoint" (the only path it allows)
    costs: tuple[RegimeCost, ...] = ()
    probe_s: float = 0.0  # how long the probe took (0 when not probed)

    def describe(self) -> str:
        """The start-up log line: the plan, then per regime its time against the best."""
        text = f"kernels ({self.source}): {self.plan.describe()}"
        if self.costs:
            cells = ", ".join(
                f"{c.rows} rows {c.chosen_s * 1e3:.2f} ms (best {c.best_s * 1e3:.2f})"
                for c in self.costs
            )
            text += f"; probe: {cells}"
            if self.probe_s:
                text += f" in {self.probe_s:.1f} s"
        return text

    def to_json(self) -> dict[str, object]:
        return {
            "plan": asdict(self.plan),
            "source": self.source,
            "costs": [asdict(c) for c in self.costs],
            "probe_s": self.probe_s,
        }


@dataclass(frozen=True)
class ModelShapes:
    """What the probe needs of a model: its projections' [in, out] shapes and its head."""

    projections: tuple[tuple[int, int], ...]  # one layer's: QKV, O, gate/up, down
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_params: int  # every weight, for the footprints

    @staticmethod
    def of(config: ModelConfig) -> ModelShapes:
        """The shapes of `config`'s model (projections fused as `model.py` fuses them)."""
        hidden, head_dim = config.hidden_size, config.head_dim
        q, kv = config.num_heads * head_dim, config.num_kv_heads * head_dim
        inter = config.intermediate_size
        projections = ((hidden, q + 2 * kv), (q, hidden), (hidden, 2 * inter), (inter, hidden))
        per_layer = sum(i * o for i, o in projections)
        embeddings = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
        return ModelShapes(
            projections,
            config.num_layers,
            hidden,
            config.vocab_size,
            config.num_layers * per_layer + embeddings,
        )

    @property
    def projection_params(self) -> int:
        return self.num_layers * sum(i * o for i, o in self.projections)

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size


def head_rows(rows: int) -> int:
    """Rows the LM head sees in a regime: every row of a decode batch, one per prefill chunk."""
    return rows if rows in DECODE_ROWS else 1


def footprint_bytes(plan: KernelPlan, shapes: ModelShapes) -> int:
    """Bytes of weights `plan` keeps: dense in its dtype, plus the 4-bit copy of the
    projections (half a byte a weight, and a bf16 scale and zero per group of 32), plus the
    head's bf16 copy."""
    dense = shapes.num_params * (4 if plan.dtype == FLOAT32 else 2)
    int4 = shapes.projection_params * (0.5 + 4 / 32) if plan.uses_int4 else 0
    head_copy = shapes.head_params * 2 if plan.head_bf16_max_rows else 0
    return int(dense + int4 + head_copy)


def candidate_plans(dtypes: Sequence[str], has_int4: bool) -> list[KernelPlan]:
    """Every plan over the probe's thresholds: dtype x 4-bit threshold x head threshold (the
    largest probed size, and so every larger input, runs the dense kernel)."""
    int4_thresholds = (0, *PROBE_ROWS[:-1]) if has_int4 else (0,)
    plans = []
    for dtype in dtypes:
        for int4_rows in int4_thresholds:
            head_choices = (0, *DECODE_ROWS) if dtype == FLOAT32 and BFLOAT16 in dtypes else (0,)
            for head_rows_max in head_choices:
                plans.append(KernelPlan(dtype, int4_rows, head_rows_max))
    return plans


class _Timings:
    """The probe's records by (part, kernel, rows); a kernel that was pruned costs infinity."""

    def __init__(self, timings: Iterable[KernelTiming]) -> None:
        self._s = {(t.part, t.kernel, t.rows): t.seconds for t in timings}

    def get(self, part: str, kernel: str, rows: int) -> float:
        return self._s.get((part, kernel, rows), math.inf)


def plan_costs(plan: KernelPlan, timings: Sequence[KernelTiming]) -> list[float]:
    """Seconds `plan` spends in each of PROBE_ROWS' regimes (layers plus head)."""
    table = _Timings(timings)
    return [
        table.get("layers", plan.layer_kernel(rows), rows)
        + table.get("head", plan.head_dtype(head_rows(rows)), head_rows(rows))
        for rows in PROBE_ROWS
    ]


def choose_plan(
    timings: Sequence[KernelTiming],
    candidates: Sequence[KernelPlan],
    shapes: ModelShapes,
    memory_bytes: int,
) -> tuple[KernelPlan, tuple[RegimeCost, ...]]:
    """The candidate closest to the best kernel in its worst regime, among those that fit
    `MEMORY_SHARE` of `memory_bytes` (the smallest footprint when none fits).

    Ties (within EQUAL_FACTOR) go to the smaller sum of ratios (every regime weighs the
    same, however long its step), then to the smaller footprint.
    """
    fits = [p for p in candidates if footprint_bytes(p, shapes) <= MEMORY_SHARE * memory_bytes]
    if not fits:
        fits = [min(candidates, key=lambda p: footprint_bytes(p, shapes))]
    costs = {plan: plan_costs(plan, timings) for plan in fits}
    best = [min(c[i] for c in costs.values()) for i in range(len(PROBE_ROWS))]

    def ratios(plan: KernelPlan) -> list[float]:
        return [c / b for c, b in zip(costs[plan], best, strict=True)]

    lowest = min(max(ratios(p)) for p in fits)
    near = [p for p in fits if max(ratios(p)) <= lowest * EQUAL_FACTOR]
    chosen = min(near, key=lambda p: (sum(ratios(p)), footprint_bytes(p, shapes)))
    regimes = tuple(
        RegimeCost(rows, chosen_s, best_s)
        for rows, chosen_s, best_s in zip(PROBE_ROWS, costs[chosen], best, strict=True)
    )
    return chosen, regimes


Measure = Callable[[str, str, int], float]  # (part, kernel, rows) -> seconds


def probe_sizes(layer_kernels: Sequence[str], head_kernels: Sequence[str]) -> int:
    """How many (part, rows) sizes `probe_kernels` times: every PROBE_ROWS size for the
    layers, the decode sizes for the LM head (a part with no kernel is not timed)."""
    return len(PROBE_ROWS) * bool(layer_kernels) + len(DECODE_ROWS) * bool(head_kernels)


def probe_kernels(
    measure: Measure,
    layer_kernels: Sequence[str],
    head_kernels: Sequence[str],
    on_size: Callable[[Sequence[KernelTiming]], None] | None = None,
) -> list[KernelTiming]:
    """Time every kernel at every PROBE_ROWS size, smallest first, pruning the hopeless
    (PRUNE_FACTOR, PRUNE_ABOVE_S) but never the fastest dense kernel, so some plan is timed at
    every size; the LM head at decode sizes only.  `on_size` hears each size's timings as
    soon as they are taken (the probe's progress: `probe_sizes` of them in all)."""
    timings = []
    for part, kernels in (("layers", layer_kernels), ("head", head_kernels)):
        alive = list(kernels)
        if not alive:
            continue
        for rows in PROBE_ROWS:
            if part == "head" and rows not in DECODE_ROWS:
                continue  # a prefill chunk's head sees one row: the 1-row figure stands
            at_size = [KernelTiming(part, k, rows, measure(part, k, rows)) for k in alive]
            timings += at_size
            if on_size is not None:
                on_size(at_size)
            fastest = min(t.seconds for t in at_size)
            limit = max(PRUNE_FACTOR * fastest, PRUNE_ABOVE_S)
            dense = [t for t in at_size if t.kernel not in _DENSE_OF]
            kept = min(dense, key=lambda t: t.seconds).kernel
            alive = [t.kernel for t in at_size if t.seconds <= limit or t.kernel == kept]
            # A 4-bit kernel serves only the model of its dtype, whose larger inputs run that
            # dtype's dense kernel: once that one is hopeless, so is the model.
            alive = [k for k in alive if part == "head" or _DENSE_OF.get(k, k) in alive]
    return timings


_DENSE_OF = {INT4: BFLOAT16, INT4_FROM_FP32: FLOAT32}


def explicit_plan(dtype: torch.dtype, use_int4: bool) -> KernelPlan:
    """The plan of `--dtype` / `--weights` given explicitly: as before the probe existed, the
    4-bit kernel for up to 16 rows when 4-bit weights are asked for, dense in `dtype`."""
    name = str(dtype).removeprefix("torch.")
    if not use_int4:
        return KernelPlan(name)
    return KernelPlan(name, EXPLICIT_INT4_MAX_ROWS, int4_dtype=name)
