"""Tiny CPU steps compute on one thread, the others on all (tokenflow/model/threads.py)."""

from __future__ import annotations

import pytest
import torch

from tests.model.helpers import chunk, plan
from tokenflow.engine import ModelExecutor
from tokenflow.model import TieredKVCache, load_model
from tokenflow.model.threads import StepThreads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_steps_under_the_threshold_run_on_one_thread_and_the_others_on_all(two_threads):
    threads = StepThreads(serial_below_tokens=8)
    assert threads.for_step(1) == 1 and torch.get_num_threads() == 1
    assert threads.for_step(7) == 1 and torch.get_num_threads() == 1
    assert threads.for_step(8) == 2 and torch.get_num_threads() == 2
    assert threads.for_step(300) == 2 and torch.get_num_threads() == 2
    assert threads.for_step(3) == 1 and torch.get_num_threads() == 1


def test_a_zero_threshold_never_changes_the_threads(two_threads):
    threads = StepThreads(serial_below_tokens=0)
    assert threads.for_step(1) == 2 and torch.get_num_threads() == 2


def test_the_executor_sizes_each_step_by_its_tokens(tiny_checkpoints, two_threads):
    _, directory = tiny_checkpoints["llama"]
    model, config, _ = load_model(str(directory), "cpu", torch.float32)
    cache = TieredKVCache(config, 16, 8, 4, "cpu", torch.float32)
    executor = ModelExecutor(model, config, cache, "cpu", seed=0, serial_below_tokens=4)
    prefill = executor.execute(plan([chunk("a", [5, 6, 7, 8, 9], 0, [0, 1])]))
    assert executor.threads.current == 2  # 5 tokens
    token = prefill.sampled[0].token_id
    executor.execute(plan([chunk("a", [token], 5, [0, 1])]))
    assert executor.threads.current == 1 and torch.get_num_threads() == 1  # one decode
