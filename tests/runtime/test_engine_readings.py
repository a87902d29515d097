"""What the layers above the engine read of a real `AsyncEngine` (tokenflow/engine/readings.py):
its description, its load report, and a replica's load taken on the engine thread."""

from __future__ import annotations

import threading

from tokenflow.engine.async_engine import AsyncEngine
from tokenflow.engine.engine_args import EngineArgs


def test_an_engine_describes_what_it_serves_with(tiny_model_dir):
    args = EngineArgs(
        model=tiny_model_dir,
        device="cpu",
        policy="fcfs",
        max_model_len=256,
        device_kv_tokens=512,
        host_kv_tokens=1024,
    )
    engine = AsyncEngine(args, start_thread=False)
    try:
        described = engine.description
        assert (described.device, described.executor, described.policy) == ("cpu", "torch", "fcfs")
        assert (described.max_model_len, described.kernels) == (256, engine.kernels)
        assert (described.num_device_blocks, described.num_host_blocks) == (32, 64)
        assert described.lines()[1] == (
            "KV tiers: device 512 tokens (32 blocks of 16), host 1024 tokens (64 blocks)"
        )
        report = engine.load_report()  # (no loop runs: this thread may read the engine)
        assert (report.num_device_blocks, report.num_host_blocks) == (32, 64)
        assert report.num_unfinished == 0 and report.num_free_device_blocks == 32
    finally:
        engine.close()


def test_a_replica_load_is_taken_on_the_engine_thread(tiny_model_dir):
    engine = AsyncEngine(EngineArgs(model=tiny_model_dir, device="cpu", max_model_len=256))
    asked: list[tuple[str, frozenset[str]]] = []

    def reached_s(now_s: float, unfinished: frozenset[str]) -> dict[str, float]:
        asked.append((threading.current_thread().name, frozenset(unfinished)))
        return {}

    try:
        load = engine.replica_load("replica-a", ["r0"], reached_s).result(timeout=60)
    finally:
        engine.close()
    assert asked == [("tokenflow-engine", frozenset())]
    assert load.replica_id == "replica-a" and load.movable == ()
    assert load.report.num_device_blocks == engine.description.num_device_blocks
