"""The benchmarks that drive the executor with hand-built plans still build valid ones.

They are scripts, not part of the package, so nothing else would notice when the plan types
change under them (a field added to `ScheduledChunk` once broke two of them silently)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tokenflow.engine import ModelExecutor, TieredKVCache, load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import engine_vs_hf  # noqa: E402
import threads  # noqa: E402


def test_threads_plan_is_a_valid_step_plan():
    plan = threads._plan(batch=2, context=3, num_tokens=1)
    assert [c.start_position for c in plan.chunks] == [3, 3]
    assert all(c.block_table_start == 0 and c.new_block_ids for c in plan.chunks)


def test_engine_vs_hf_runner_generates_through_the_executor(tiny_model_dir):
    model, config, _ = load_model(tiny_model_dir, "cpu", torch.float32)
    blocks = 2 * -(-16 // engine_vs_hf.BLOCK_SIZE)
    kv_cache = TieredKVCache(config, blocks, 1, engine_vs_hf.BLOCK_SIZE, "cpu", model.dtype)
    runner = engine_vs_hf.OurRunner(ModelExecutor(model, config, kv_cache, "cpu"), max_len=16)
    timing = runner.generate([[5, 6, 7], [8, 9, 10]], new_tokens=3)
    assert len(timing.step_s) == 2 and timing.prefill_s > 0
