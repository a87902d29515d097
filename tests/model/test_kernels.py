"""The kernel chooser: a fake timer decides, memory limits hold, the cache is keyed and
invalidated, explicit flags skip the probe, and the loaded model runs the chosen plan."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from tests.model.helpers import (
    DECISIVE_PROMPT,
    bf16_logit_bound,
    loaded_greedy,
    loaded_prefill_logits,
)
from tokenflow.model import load_model
from tokenflow.model import loader as loader_module
from tokenflow.model.config import ModelConfig
from tokenflow.model.kernels import (
    BFLOAT16,
    FLOAT32,
    INT4,
    INT4_FROM_FP32,
    PROBE_ROWS,
    KernelCache,
    KernelChoice,
    KernelPlan,
    ModelShapes,
    ProbeSettings,
    candidate_plans,
    choose_kernels,
    choose_plan,
    footprint_bytes,
    probe_kernels,
)

SHAPES = ModelShapes(((64, 128), (64, 64), (64, 256), (128, 64)), 4, 64, 1000, 200_000)
BOTH = (FLOAT32, BFLOAT16)
LAYER_KERNELS = [FLOAT32, BFLOAT16, INT4_FROM_FP32, INT4]
HEAD_KERNELS = [FLOAT32, BFLOAT16]


class FakeTimer:
    """(part, kernel, rows) -> seconds from a table; records every call."""

    def __init__(self, layers: dict[str, dict[int, float]], head: dict[str, dict[int, float]]):
        self.table = {"layers": layers, "head": head}
        self.calls: list[tuple[str, str, int]] = []

    def __call__(self, part: str, kernel: str, rows: int) -> float:
        self.calls.append((part, kernel, rows))
        return self.table[part][kernel][rows] * 1e-3  # the tables are in milliseconds


def by_rows(*values: float) -> dict[int, float]:
    return dict(zip(PROBE_ROWS, values, strict=True))


def head_by_rows(one: float, eight: float, thirty_two: float) -> dict[int, float]:
    return {1: one, 8: eight, 32: thirty_two}


# An AVX2-like machine: emulated bf16 GEMMs are hopeless, 4-bit wins small decode batches, the
# bf16 head copy wins up to 8 rows and loses at 32.
AVX2_LIKE = FakeTimer(
    layers={
        FLOAT32: by_rows(8, 30, 70, 100, 300),
        BFLOAT16: by_rows(130, 1200, 4700, 9600, 37000),
        INT4_FROM_FP32: by_rows(7, 20, 90, 130, 640),
        INT4: by_rows(7.5, 19, 100, 140, 540),
    },
    head={FLOAT32: head_by_rows(11, 19, 26), BFLOAT16: head_by_rows(2.4, 17.5, 68)},
)
# A machine with native bf16: bf16 wins everything but the single-row projection (4-bit).
BF16_NATIVE = FakeTimer(
    layers={
        FLOAT32: by_rows(8, 24, 58, 106, 347),
        BFLOAT16: by_rows(8, 12, 26, 42, 140),
        INT4_FROM_FP32: by_rows(4.2, 12.6, 50, 100, 392),
        INT4: by_rows(3.9, 11.4, 47, 92, 381),
    },
    head={FLOAT32: head_by_rows(9.8, 18.7, 29.4), BFLOAT16: head_by_rows(3.4, 5.6, 8.7)},
)


def choose(timer: FakeTimer, memory_bytes: int = 1 << 40) -> KernelPlan:
    timings = probe_kernels(timer, LAYER_KERNELS, HEAD_KERNELS)
    return choose_plan(timings, candidate_plans(BOTH, True), SHAPES, memory_bytes)[0]


def test_the_fastest_kernel_per_regime_is_taken_on_an_avx2_like_cpu():
    plan = choose(AVX2_LIKE)
    assert plan == KernelPlan(FLOAT32, int4_max_rows=8, head_bf16_max_rows=8)
    assert plan.layer_kernel(8) == INT4_FROM_FP32 and plan.layer_kernel(9) == FLOAT32
    assert plan.head_dtype(8) == BFLOAT16 and plan.head_dtype(9) == FLOAT32


def test_the_fastest_kernel_per_regime_is_taken_with_native_bf16():
    assert choose(BF16_NATIVE) == KernelPlan(BFLOAT16, int4_max_rows=8)


def test_the_chosen_plan_is_within_the_best_of_each_regime_on_both_machines():
    for timer in (AVX2_LIKE, BF16_NATIVE):
        timings = probe_kernels(timer, LAYER_KERNELS, HEAD_KERNELS)
        _, costs = choose_plan(timings, candidate_plans(BOTH, True), SHAPES, 1 << 40)
        assert [c.rows for c in costs] == list(PROBE_ROWS)
        assert all(c.chosen_s <= 1.1 * c.best_s for c in costs), costs


def test_a_hopeless_kernel_is_not_timed_at_larger_sizes():
    timer = FakeTimer(AVX2_LIKE.table["layers"], AVX2_LIKE.table["head"])
    probe_kernels(timer, LAYER_KERNELS, HEAD_KERNELS)
    bf16_layer_rows = [
        rows for part, kernel, rows in timer.calls if (part, kernel) == ("layers", BFLOAT16)
    ]
    assert bf16_layer_rows == [1]  # 130 ms > 4 x 7 at one row: never timed again
    # a cheap kernel is timed on even when it trails (the fp32 head: 11 ms against 2.4)
    assert ("head", FLOAT32, 32) in timer.calls
    # the head is timed at decode sizes only (a prefill chunk's head sees one row)
    assert {rows for part, _, rows in timer.calls if part == "head"} == {1, 8, 32}


def test_the_fastest_dense_kernel_is_timed_on_when_a_4_bit_kernel_outruns_every_dense_one():
    # A loaded machine's moment: at one row every dense kernel takes over 4x the 4-bit ones and
    # over 0.1 s.  The 4-bit kernels stand on their dense twins, so pruning every dense kernel
    # left nothing to time at the next size (the probe failed on `min()` of nothing).
    timer = FakeTimer(
        layers={
            FLOAT32: by_rows(150, 30, 70, 100, 300),
            BFLOAT16: by_rows(400, 1200, 4700, 9600, 37000),
            INT4_FROM_FP32: by_rows(7, 20, 90, 130, 640),
            INT4: by_rows(7.5, 19, 100, 140, 540),
        },
        head=AVX2_LIKE.table["head"],
    )
    timings = probe_kernels(timer, LAYER_KERNELS, HEAD_KERNELS)
    fp32_rows = [t.rows for t in timings if (t.part, t.kernel) == ("layers", FLOAT32)]
    assert fp32_rows == list(PROBE_ROWS)  # the fastest dense kernel, timed at every size
    plan, _ = choose_plan(timings, candidate_plans(BOTH, True), SHAPES, 1 << 40)
    assert plan.dtype == FLOAT32


def test_plans_that_do_not_fit_the_memory_are_not_chosen():
    fp32_plan = KernelPlan(FLOAT32, 8, 1)
    bf16_plan = KernelPlan(BFLOAT16, 8)
    assert footprint_bytes(bf16_plan, SHAPES) < footprint_bytes(fp32_plan, SHAPES)
    # AVX2-like timings favour float32, but only bfloat16 weights fit
    memory = math.ceil(footprint_bytes(KernelPlan(BFLOAT16, 1), SHAPES) / 0.8)
    plan = choose(AVX2_LIKE, memory_bytes=memory)
    assert plan.dtype == BFLOAT16
    assert footprint_bytes(plan, SHAPES) <= 0.8 * memory


def test_the_smallest_plan_is_taken_when_nothing_fits():
    plan = choose(AVX2_LIKE, memory_bytes=1)
    smallest = min(candidate_plans(BOTH, True), key=lambda p: footprint_bytes(p, SHAPES))
    assert plan == smallest and not plan.uses_int4 and plan.dtype == BFLOAT16


def test_a_float32_checkpoint_has_one_plan_and_is_not_probed(tmp_path):
    def refuse(*args: object) -> float:
        raise AssertionError("probed")

    choice = choose_kernels(
        SHAPES, tmp_path, (FLOAT32,), False, ProbeSettings(cache=KernelCache(tmp_path)), refuse
    )
    assert choice == KernelChoice(KernelPlan(FLOAT32), "checkpoint")


# -- the cache ---------------------------------------------------------------------------------
@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"weights")
    return path


def _choose(model_file, cache_dir, timer, use_cache=True) -> KernelChoice:
    settings = ProbeSettings(
        serial_below_tokens=8, use_cache=use_cache, cache=KernelCache(cache_dir)
    )
    return choose_kernels(SHAPES, model_file, BOTH, True, settings, timer, memory_bytes=1 << 40)


def test_a_second_start_reads_the_cached_choice_without_probing(model_file, tmp_path):
    first = _choose(model_file, tmp_path / "cache", AVX2_LIKE)
    assert first.source == "probe"
    again = _choose(model_file, tmp_path / "cache", BF16_NATIVE)  # other timings: unused
    assert again.source == "cache" and again.plan == first.plan
    assert [c.rows for c in again.costs] == list(PROBE_ROWS)


def test_no_kernel_cache_probes_again_and_stores_nothing(model_file, tmp_path):
    _choose(model_file, tmp_path / "cache", AVX2_LIKE)
    fresh = _choose(model_file, tmp_path / "cache", BF16_NATIVE, use_cache=False)
    assert fresh.source == "probe" and fresh.plan.dtype == BFLOAT16
    assert _choose(model_file, tmp_path / "cache", BF16_NATIVE).plan.dtype == FLOAT32  # kept
    _choose(model_file, tmp_path / "unused", BF16_NATIVE, use_cache=False)
    assert not (tmp_path / "unused").exists()


def test_the_probe_says_what_it_times_and_where_it_caches_the_choice(model_file, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tokenflow.model.kernels")
    _choose(model_file, tmp_path / "cache", AVX2_LIKE)
    (stored,) = (tmp_path / "cache").glob("*.json")
    first, *progress, last = [r.getMessage() for r in caplog.records]
    assert first.startswith("kernel probe: timing") and f"stored in {stored}" in first
    sizes = [("layers", rows) for rows in PROBE_ROWS] + [("head", rows) for rows in (1, 8, 32)]
    assert [m.split(":")[0:2] for m in progress] == [
        [f"kernel probe {i}/{len(sizes)}", f" {part} at {rows} rows"]
        for i, (part, rows) in enumerate(sizes, start=1)
    ]
    assert last.startswith("kernel probe: done in") and last.endswith(f"wrote {stored}")

    caplog.clear()
    _choose(model_file, tmp_path / "cache", BF16_NATIVE)
    (cached,) = [r.getMessage() for r in caplog.records]
    assert cached.startswith("kernels: using the choice probed") and str(stored) in cached


def test_a_probe_without_the_cache_says_it_stores_nothing(model_file, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tokenflow.model.kernels")
    _choose(model_file, tmp_path / "cache", AVX2_LIKE, use_cache=False)
    messages = [r.getMessage() for r in caplog.records]
    assert "not stored: --no-kernel-cache" in messages[0]
    assert messages[-1].startswith("kernel probe: done in") and "wrote" not in messages[-1]


@pytest.mark.parametrize(
    "change",
    ["threads", "isa_limit", "model_file"],
)
def test_the_cache_is_keyed_by_threads_isa_limits_and_the_model(
    model_file, tmp_path, monkeypatch, change
):
    _choose(model_file, tmp_path / "cache", AVX2_LIKE)
    if change == "threads":
        threads = torch.get_num_threads()
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    elif change == "isa_limit":
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    else:
        model_file.write_bytes(b"other weights")
    choice = _choose(model_file, tmp_path / "cache", BF16_NATIVE)
    assert choice.source == "probe" and choice.plan.dtype == BFLOAT16


def test_a_corrupt_cache_file_is_probed_over(model_file, tmp_path):
    _choose(model_file, tmp_path / "cache", AVX2_LIKE)
    (stored,) = (tmp_path / "cache").glob("*.json")
    stored.write_text("{not json")
    assert _choose(model_file, tmp_path / "cache", BF16_NATIVE).source == "probe"
    record = json.loads(stored.read_text())
    assert record["choice"]["plan"]["dtype"] == BFLOAT16


# -- the loader ------------------------------------------------------------------------------------
def test_explicit_flags_skip_the_probe(smollm, tiny_checkpoints, monkeypatch):
    def refuse(*args: object, **kwargs: object) -> KernelChoice:
        raise AssertionError("probed")

    monkeypatch.setattr(loader_module, "choose_kernels", refuse)
    assert smollm.model.kernel_choice == KernelChoice(KernelPlan(FLOAT32), "flags")
    loaded = load_model(str(tiny_checkpoints["llama"][1]), "cpu", weights="dense")
    assert loaded.model.kernel_choice.source == "flags"


def test_a_float32_checkpoint_loads_dense_float32_without_a_probe(tiny_checkpoints):
    loaded = load_model(str(tiny_checkpoints["llama"][1]), "cpu")  # tiny models are stored fp32
    assert loaded.model.kernel_choice == KernelChoice(KernelPlan(FLOAT32), "checkpoint")
    assert loaded.model.dtype == torch.float32


def test_model_shapes_count_the_fused_projections():
    config = ModelConfig(
        architecture="llama",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=True,
        attention_bias=False,
    )
    shapes = ModelShapes.of(config)
    assert shapes.projections == ((64, 64 + 2 * 32), (64, 64), (64, 256), (128, 64))
    assert shapes.num_params == 2 * (64 * 128 + 64 * 64 + 64 * 256 + 128 * 64) + 100 * 64


PLANS = {
    "bf16-native-like": KernelPlan(BFLOAT16, int4_max_rows=1),
    "avx2-like": KernelPlan(FLOAT32, int4_max_rows=8, head_bf16_max_rows=1),
    "fp32-wide-int4": KernelPlan(FLOAT32, int4_max_rows=32, head_bf16_max_rows=8),
}


@pytest.fixture(scope="module")
def planned_models(pytestconfig):
    """The embedded SmolLM2 loaded as each plan says (the loader's choice replaced)."""
    models = {}
    with pytest.MonkeyPatch.context() as patch:
        for name, plan in PLANS.items():
            patch.setattr(
                loader_module, "choose_kernels", lambda *a, p=plan, **k: KernelChoice(p, "probe")
            )
            models[name] = load_model(None, "cpu")
    return models


def test_the_loaded_model_runs_the_plan(planned_models):
    model = planned_models["avx2-like"].model
    proj = model.layers[0].mlp.gate_up_proj
    assert model.dtype == torch.float32
    assert proj.int4 is not None and proj.int4_max_rows == 8 and proj.int4.dtype == torch.bfloat16
    assert model.lm_head.bf16_weight is not None and model.lm_head.bf16_max_rows == 1
    assert model.lm_head(torch.zeros(1, 576)).dtype == torch.bfloat16
    assert model.lm_head(torch.zeros(2, 576)).dtype == torch.float32
    bf16 = planned_models["bf16-native-like"].model
    assert bf16.dtype == torch.bfloat16 and bf16.lm_head.bf16_weight is None


@pytest.mark.parametrize("name", sorted(PLANS))
def test_every_chosen_plan_keeps_the_dense_greedy_tokens(smollm, planned_models, name):
    # Dense float32 is the transformers oracle (test_real_model); a plan differs from it by
    # bf16 roundings only, inside the bound, and keeps a decisive prompt's greedy tokens.
    loaded = planned_models[name]
    prompt = smollm.tokenizer.encode(DECISIVE_PROMPT)
    assert loaded_greedy(loaded, prompt, 12) == loaded_greedy(smollm, prompt, 12)
    dense_logits = loaded_prefill_logits(smollm, prompt)
    diff = (loaded_prefill_logits(loaded, prompt).float() - dense_logits).abs().max()
    assert diff < bf16_logit_bound(dense_logits, smollm.config.num_layers), diff
