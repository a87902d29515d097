"""The executor's step semantics: copies done when the step is (on CPU before the forward, on
CUDA beside it), results per sampling chunk."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.model.helpers import GREEDY_NO_EOS, chunk, greedy_generate, plan
from tokenflow.core.plan import BlockCopy, CopyKind
from tokenflow.core.request import SamplingParams
from tokenflow.engine import ModelExecutor
from tokenflow.model import TieredKVCache, load_model

PROMPT_A = [5, 6, 7, 8, 9, 10, 11]
PROMPT_B = [40, 41, 42, 43, 44]


def _executor(tiny_checkpoints, device: str = "cpu", kind: str = "llama") -> ModelExecutor:
    _, directory = tiny_checkpoints[kind]
    model, config, _ = load_model(str(directory), device, torch.float32)
    cache = TieredKVCache(config, 16, 8, 4, device, torch.float32)
    return ModelExecutor(model, config, cache, device, seed=0)


def test_only_sampling_chunks_return_tokens_in_plan_order(tiny_checkpoints):
    executor = _executor(tiny_checkpoints)
    result = executor.execute(
        plan(
            [
                chunk("a", PROMPT_A[:4], 0, [0, 1], samples_token=False),
                chunk("b", PROMPT_B, 0, [2, 3]),
                chunk("c", [9], 0, [4]),
            ]
        )
    )
    assert [s.request_id for s in result.sampled] == ["b", "c"]
    assert executor.execute(plan([])).sampled == ()


def test_tokens_come_in_plan_order_when_rows_run_decodes_first(tiny_checkpoints):
    """The forward puts single-token chunks first; the tokens still follow the plan's order
    (step semantics 4: the scheduler pairs them with chunks by position)."""
    executor = _executor(tiny_checkpoints)
    result = executor.execute(
        plan(
            [
                chunk("p1", PROMPT_B, 0, [0, 1]),
                chunk("d1", [9], 0, [2]),
                chunk("p2", PROMPT_A[:4], 0, [3], samples_token=False),
                chunk("p3", PROMPT_A, 0, [4, 5]),
                chunk("d2", [8], 0, [6]),
            ]
        )
    )
    assert [s.request_id for s in result.sampled] == ["p1", "d1", "p3", "d2"]


def test_cpu_copies_run_on_the_step_thread_before_the_forward(tiny_checkpoints, monkeypatch):
    """On CPU a concurrent copy takes a core from the forward's threads: the copies run first,
    on the calling thread, and are done when the step is."""
    executor = _executor(tiny_checkpoints)
    [expected] = greedy_generate(executor, [PROMPT_B], [[6, 7]], num_new=3)
    events = []
    copy, forward = executor.kv_cache.apply_copies, executor.model.forward

    def recording_copy(device_to_host, host_to_device):
        events.append(
            ("copy", threading.current_thread(), len(device_to_host), len(host_to_device))
        )
        copy(device_to_host, host_to_device)

    def recording_forward(*args, **kwargs):
        events.append(("forward", threading.current_thread()))
        return forward(*args, **kwargs)

    monkeypatch.setattr(executor.kv_cache, "apply_copies", recording_copy)
    greedy_generate(executor, [PROMPT_A], [[0, 1]], num_new=1)  # fills device blocks 0, 1
    monkeypatch.setattr(executor.model, "forward", recording_forward)
    copies = [BlockCopy("a", CopyKind.WRITE_THROUGH, 0, 5), BlockCopy("a", CopyKind.EVICT, 1, 6)]
    loads = [BlockCopy("z", CopyKind.LOAD, 0, 9)]
    result = executor.execute(
        plan([chunk("b", PROMPT_B, 0, [6, 7], 0, True, GREEDY_NO_EOS)], copies, loads)
    )
    assert result.sampled[0].token_id == expected[0]  # the forward is unaffected by copies
    here = threading.current_thread()
    assert events == [("copy", here, 2, 1), ("forward", here)]
    torch.testing.assert_close(
        executor.kv_cache.host_kv[:, :, 5:7], executor.kv_cache.device_kv[:, :, 0:2]
    )


def test_a_failing_copy_surfaces_from_execute(tiny_checkpoints):
    executor = _executor(tiny_checkpoints)
    bad = [BlockCopy("a", CopyKind.EVICT, 0, 999)]
    with pytest.raises(IndexError, match="out of range"):
        executor.execute(plan([chunk("b", PROMPT_B, 0, [2, 3])], device_to_host=bad))


def test_released_requests_lose_their_penalty_counts(tiny_checkpoints):
    executor = _executor(tiny_checkpoints)
    params = SamplingParams(temperature=1.0, seed=5, presence_penalty=0.5)
    executor.execute(plan([chunk("a", PROMPT_A, 0, [0, 1], 0, True, params)]))
    assert len(executor.token_counts) == 1
    executor.execute(plan([], released=["a"]))
    assert len(executor.token_counts) == 0


def test_seeded_sampling_is_reproducible_through_the_executor(tiny_checkpoints):
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=42)
    runs = []
    for _ in range(2):
        executor = _executor(tiny_checkpoints)
        runs.append(greedy_generate(executor, [PROMPT_A], [[0, 1, 2, 3]], 8, params=params)[0])
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu_with_copies_on_the_copy_stream(tiny_checkpoints):
    cpu = _executor(tiny_checkpoints, "cpu", "qwen2")
    gpu = _executor(tiny_checkpoints, "cuda", "qwen2")
    prompts, tables = [PROMPT_A, PROMPT_B], [[0, 1, 2], [3, 4, 5]]
    assert greedy_generate(gpu, prompts, tables, 8) == greedy_generate(cpu, prompts, tables, 8)
    evict = [BlockCopy("a", CopyKind.EVICT, 0, 1), BlockCopy("a", CopyKind.EVICT, 1, 2)]
    gpu.execute(plan([chunk("c", PROMPT_B, 0, [8, 9])], device_to_host=evict))
    host = gpu.kv_cache.host_kv[:, :, 1:3].to("cuda")
    torch.testing.assert_close(host, gpu.kv_cache.device_kv[:, :, 0:2])
    gpu.execute(plan([], host_to_device=[BlockCopy("a", CopyKind.LOAD, 1, 12)]))
    torch.testing.assert_close(gpu.kv_cache.device_kv[:, :, 12], gpu.kv_cache.device_kv[:, :, 0])


def test_decode_path_is_measured_once_then_cached_and_keeps_the_tokens(tiny_checkpoints, tmp_path):
    """Without a flag the executor times eager against compiled decode steps, stores the
    choice, and a later executor takes it from the cache; either way the tokens are eager's."""
    from tokenflow.model.decode_path import (
        DecodePathCache,
        DecodePathChoice,
        DecodePathSettings,
        DecodePathTiming,
    )

    _, directory = tiny_checkpoints["llama"]
    settings = DecodePathSettings({"test": str(directory)}, cache=DecodePathCache(tmp_path))

    def build(compile_decode: bool | None) -> ModelExecutor:
        model, config, _ = load_model(str(directory), "cpu", torch.float32)
        cache = TieredKVCache(config, 16, 8, 4, "cpu", torch.float32)
        return ModelExecutor(
            model, config, cache, "cpu", compile_decode=compile_decode, decode_settings=settings
        )

    probed = build(None)
    assert probed.decode_path.source == "probe"
    assert [t.rows for t in probed.decode_path.timings] == [1, 8, 32]
    cached = build(None)
    assert cached.decode_path.source == "cache"
    assert cached.decode_path.compiled_max_rows == probed.decode_path.compiled_max_rows
    assert (cached.decoder is not None) == (cached.decode_path.compiled_max_rows > 0)
    eager = build(False)
    assert eager.decoder is None and eager.decode_path.source == "flags"
    prompts, tables = [PROMPT_A, PROMPT_B], [[0, 1, 2, 3], [4, 5, 6, 7]]
    expected = greedy_generate(eager, prompts, tables, num_new=6)
    assert greedy_generate(cached, prompts, tables, num_new=6) == expected
    # A stored choice of compiled steps for one stream only: two streams decode eagerly.
    timings = (DecodePathTiming(1, 2.0, 1.0), DecodePathTiming(8, 1.0, 2.0))
    settings = DecodePathSettings({"test": "one"}, cache=settings.cache)
    settings.cache.store(settings.key, DecodePathChoice(1, "probe", timings))
    one = build(None)
    assert one.decode_path.compiled_max_rows == 1 and one.decoder is not None
    compiled_rows = []
    forward = one.decoder.forward
    one.decoder.forward = lambda ids, *rest: compiled_rows.append(len(ids)) or forward(ids, *rest)
    assert greedy_generate(one, prompts, tables, num_new=6) == expected
    assert greedy_generate(one, prompts[:1], tables[:1], num_new=6) == expected[:1]
    assert compiled_rows == [1] * 5  # the lone stream's decode steps, and only those
