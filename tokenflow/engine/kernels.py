"""Which kernels the model's matrix multiplies take on a CPU: measured on the machine at hand.

The same GGUF can run through very different kernels, and which is fastest depends on the CPU
more than on anything else: on a CPU with native bfloat16 (AVX-512-bf16, AMX) a bf16 GEMM beats
float32 by 2-3x, while on one without (AVX2 only) the same bf16 GEMM is emulated and runs
10-100x slower than float32.  So the engine does not guess from flags; it times the loaded
model's own shapes under each kernel and keeps what is fastest in each regime.

A `KernelPlan` is the choice.  It names
- the activation dtype (and that of every dense weight): float32 or bfloat16;
- `int4_max_rows`: the layers' projections take torch's packed 4-bit kernel (bf16 inside it)
  for inputs of at most this many rows, their dense copy above (0: no 4-bit kernel at all);
- `head_bf16_max_rows`: in a float32 model, the LM head reads a bfloat16 copy of its weight for
  inputs of at most this many rows (the head is one wide memory-bound matrix: half the bytes).

The probe (`probe_kernels`) times, for the row counts in `PROBE_ROWS` (decode batches 1/8/32,
prefill chunks 64/256), every layer's four projections under each kernel and the LM head in
each dtype, each on the thread count the engine would use for such a step; a kernel more than
`PRUNE_FACTOR` times slower than the best at some size is not timed at larger ones.
`choose_plan` then takes, among the plans whose weights fit the memory the host has, the one
whose worst regime is closest to that regime's best kernel.  The choice is cached per machine,
torch, model and threads (`KernelCache`), so a second start does not probe again.

Numerics: only dense float32 reproduces transformers' float32 logits; the 4-bit kernel and any
bfloat16 path round activations to bf16.  So automatic choice never goes below the precision a
checkpoint is stored in: an HF checkpoint stored in float32 runs dense float32 and is not probed;
a quantized GGUF or a bf16 checkpoint may run in bf16.  `--dtype` / `--weights` given explicitly
skip the probe (`explicit_plan`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tokenflow.engine.model_config import ModelConfig

logger = logging.getLogger(__name__)

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
# The probe cycles through distinct copies of a layer's weights up to this many bytes (or the
# model's layer count), so that, as in the model, weights stream from memory rather than
# staying in the CPU's caches: one cached layer would flatter the largest (float32) weights at
# small, memory-bound batches.
PROBE_WEIGHT_BYTES = 128 << 20
# What the four kernels are called in the probe's records.
INT4 = "int4"  # packed 4-bit codes, bf16 activations
INT4_FROM_FP32 = "int4-from-float32"  # the same kernel inside a float32 model (casts around it)
CACHE_VERSION = 1
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


# -- measuring ------------------------------------------------------------------------------------
Measure = Callable[[str, str, int], float]  # (part, kernel, rows) -> seconds


def probe_kernels(
    measure: Measure, layer_kernels: Sequence[str], head_kernels: Sequence[str]
) -> list[KernelTiming]:
    """Time every kernel at every PROBE_ROWS size, smallest first, pruning the hopeless
    (PRUNE_FACTOR, PRUNE_ABOVE_S); the LM head at decode sizes only."""
    timings = []
    for part, kernels in (("layers", layer_kernels), ("head", head_kernels)):
        alive = list(kernels)
        for rows in PROBE_ROWS:
            if part == "head" and rows not in DECODE_ROWS:
                continue  # a prefill chunk's head sees one row: the 1-row figure stands
            at_size = [KernelTiming(part, k, rows, measure(part, k, rows)) for k in alive]
            timings += at_size
            fastest = min(t.seconds for t in at_size)
            limit = max(PRUNE_FACTOR * fastest, PRUNE_ABOVE_S)
            alive = [t.kernel for t in at_size if t.seconds <= limit]
            # A 4-bit kernel serves only the model of its dtype, whose larger inputs run that
            # dtype's dense kernel: once that one is hopeless, so is the model.
            alive = [k for k in alive if part == "head" or _DENSE_OF.get(k, k) in alive]
    return timings


_DENSE_OF = {INT4: BFLOAT16, INT4_FROM_FP32: FLOAT32}


class TorchMeasure:
    """Times random weights of the model's shapes with the kernels the model would call.

    Each measurement runs on the threads the engine would give a step of that many rows
    (`threads_for_rows`), best of a few repeats after a warm-up, over distinct copies of one
    layer's weights (PROBE_WEIGHT_BYTES), scaled to the model's layer count.
    """

    def __init__(self, shapes: ModelShapes, threads_for_rows: Callable[[int], int]) -> None:
        from tokenflow.engine.quant import Int4Weight, PackedInt4

        self.shapes = shapes
        self.threads_for_rows = threads_for_rows
        gen = torch.Generator().manual_seed(0)
        fp32 = [torch.randn(i, o, generator=gen) * 0.02 for i, o in shapes.projections]
        self._dense = {
            FLOAT32: _layer_copies(fp32, lambda w: w.clone(), shapes.num_layers),
            BFLOAT16: _layer_copies(
                [w.bfloat16() for w in fp32], lambda w: w.clone(), shapes.num_layers
            ),
        }
        int4 = [
            PackedInt4(
                Int4Weight(
                    torch.randint(0, 16, (o, i), generator=gen, dtype=torch.uint8),
                    torch.full((o, i // 32), 0.01),
                    torch.full((o, i // 32), -0.08),
                ),
                torch.bfloat16,
            )
            for i, o in shapes.projections
        ]
        self._int4 = _layer_copies(int4, lambda w: w.clone(), shapes.num_layers)
        head = torch.randn(shapes.vocab_size, shapes.hidden_size, generator=gen) * 0.02
        self._head = {FLOAT32: head, BFLOAT16: head.bfloat16()}

    def __call__(self, part: str, kernel: str, rows: int) -> float:
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads_for_rows(rows))
        try:
            if part == "head":
                x = torch.randn(rows, self.shapes.hidden_size).to(getattr(torch, kernel))
                weight = self._head[kernel]
                return _best_of(lambda: torch.nn.functional.linear(x, weight))
            copies = self._int4 if kernel in (INT4, INT4_FROM_FP32) else self._dense[kernel]
            per_copy_s = _best_of(self._layers(kernel, rows, copies)) / len(copies)
            return self.shapes.num_layers * per_copy_s
        finally:
            torch.set_num_threads(previous)

    def _layers(self, kernel: str, rows: int, copies: list[list]) -> Callable[[], object]:
        """One pass over every copy: each layer's four projections of a [rows, in] input."""
        if kernel in (FLOAT32, BFLOAT16):
            dtype = getattr(torch, kernel)
            inputs = [torch.randn(rows, i).to(dtype) for i, _ in self.shapes.projections]
            return lambda: [
                torch.mm(x, w) for layer in copies for x, w in zip(inputs, layer, strict=True)
            ]
        source = torch.float32 if kernel == INT4_FROM_FP32 else torch.bfloat16
        inputs = [torch.randn(rows, i).to(source) for i, _ in self.shapes.projections]
        if kernel == INT4_FROM_FP32:
            return lambda: [
                p.matmul(x.bfloat16()).float()
                for layer in copies
                for x, p in zip(inputs, layer, strict=True)
            ]
        return lambda: [p.matmul(x) for layer in copies for x, p in zip(inputs, layer, strict=True)]


def _layer_copies(layer: list, clone: Callable, num_layers: int) -> list[list]:
    """`layer` and clones of it: as many as PROBE_WEIGHT_BYTES holds, at most `num_layers`."""
    layer_bytes = sum(_nbytes(w) for w in layer)
    count = max(1, min(num_layers, math.ceil(PROBE_WEIGHT_BYTES / max(layer_bytes, 1))))
    return [layer] + [[clone(w) for w in layer] for _ in range(count - 1)]


def _nbytes(weight: object) -> int:
    if isinstance(weight, torch.Tensor):
        return weight.nbytes
    return weight.nbytes()  # PackedInt4


def _best_of(fn: Callable[[], object], min_total_s: float = 0.05, max_repeats: int = 7) -> float:
    """Best time of `fn` after one warm-up: repeats until `min_total_s` passed (2 at least,
    `max_repeats` at most), so cheap kernels are timed often and slow ones few times."""
    fn()
    best, total, repeats = math.inf, 0.0, 0
    while repeats < 2 or (total < min_total_s and repeats < max_repeats):
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, total, repeats = min(best, took), total + took, repeats + 1
    return best


# -- the cache -----------------------------------------------------------------------------------
def machine_key(threads: int, serial_below_tokens: int) -> dict[str, object]:
    """What makes one machine's timings differ from another's: the CPU (model and flags), the
    kernels torch dispatches to (its version, capability and the ISA limits set in the
    environment) and the threads a step runs on."""
    model_name, flags = _cpuinfo()
    return {
        "cpu": model_name,
        "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY", ""),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        "mkl_enable_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS", ""),
        "threads": threads,
        "serial_below_tokens": serial_below_tokens,
    }


def model_key(path: Path, dtypes: Sequence[str], has_int4: bool) -> dict[str, object]:
    """The model file (resolved path, size, modification time) and the paths it allows."""
    resolved = path.resolve()
    stat = resolved.stat()
    return {
        "model": str(resolved),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "dtypes": list(dtypes),
        "int4": has_int4,
    }


def _cpuinfo() -> tuple[str, str]:
    """(model name, flags) from /proc/cpuinfo; the platform's names where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.processor() or platform.machine(), ""
    fields_of: dict[str, str] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields_of.setdefault(name.strip(), value.strip())
    return fields_of.get("model name", platform.machine()), fields_of.get("flags", "")


def default_cache_dir() -> Path:
    """$TOKENFLOW_CACHE_DIR, else $XDG_CACHE_HOME/tokenflow, else ~/.cache/tokenflow."""
    if os.environ.get("TOKENFLOW_CACHE_DIR"):
        return Path(os.environ["TOKENFLOW_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenflow"


@dataclass
class KernelCache:
    """Kernel choices on disk, one JSON file per key (machine + model), under `directory`."""

    directory: Path = field(default_factory=lambda: default_cache_dir() / "kernels")

    def path_for(self, key: dict[str, object]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return self.directory / f"{digest}.json"

    def load(self, key: dict[str, object]) -> KernelChoice | None:
        """The choice stored for exactly `key`, or None (absent, another key, unreadable)."""
        path = self.path_for(key)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("version") != CACHE_VERSION or data.get("key") != key:
                return None
            choice = data["choice"]
            return KernelChoice(
                KernelPlan(**choice["plan"]),
                "cache",
                tuple(RegimeCost(**c) for c in choice["costs"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def store(self, key: dict[str, object], choice: KernelChoice) -> None:
        """Write the choice (atomically); a cache that cannot be written is only logged."""
        path = self.path_for(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".tmp")
            record = {"version": CACHE_VERSION, "key": key, "choice": choice.to_json()}
            partial.write_text(json.dumps(record, indent=1), encoding="utf-8")
            partial.replace(path)
        except OSError as exc:
            logger.warning("cannot write the kernel cache %s: %s", path, exc)


# -- the one entry point --------------------------------------------------------------------------
@dataclass(frozen=True)
class ProbeSettings:
    """How an automatic choice is made: the engine's single-thread rule, and the cache."""

    serial_below_tokens: int = 0  # steps of fewer tokens run on one thread (engine/threads.py)
    use_cache: bool = True  # False: probe anew and do not store (`--no-kernel-cache`)
    cache: KernelCache | None = None  # None: the user cache dir


def explicit_plan(dtype: torch.dtype, use_int4: bool) -> KernelPlan:
    """The plan of `--dtype` / `--weights` given explicitly: as before the probe existed, the
    4-bit kernel for up to 16 rows when 4-bit weights are asked for, dense in `dtype`."""
    name = str(dtype).removeprefix("torch.")
    if not use_int4:
        return KernelPlan(name)
    return KernelPlan(name, EXPLICIT_INT4_MAX_ROWS, int4_dtype=name)


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
        from tokenflow.engine.kv_cache import available_memory_bytes

        memory_bytes = available_memory_bytes(torch.device("cpu"))
    plan, costs = choose_plan(timings, candidates, shapes, memory_bytes)
    choice = KernelChoice(plan, "probe", costs, time.perf_counter() - started)
    if settings.use_cache:
        cache.store(key, choice)
    return choice
