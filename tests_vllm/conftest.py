"""Tests of the vLLM integration: run in a venv with vLLM (`make test-vllm`), never by `make test`.

The model is the embedded SmolLM2 converted to a Hugging Face directory (made by `make
test-vllm`; `TOKENFLOW_VLLM_MODEL_DIR` points at it).  vLLM runs in-process on the CPU with a
tiny KV pool (7 blocks of 32 tokens), so preemption is forced.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

# Before vLLM is imported: the engine in this process (its scheduler can be inspected), and no
# thread pinning on a small shared machine.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

SCHEDULER_CLS = "tokenflow.integrations.vllm.TokenFlowScheduler"
NUM_BLOCKS = 7  # one is vLLM's null block: 6 x 32 = 192 tokens for every stream together
BLOCK_SIZE = 32
# Short decisions so a test of a few seconds sees many of them.
POLICY = {"schedule_interval_s": 0.05, "critical_slack_s": 0.2}


@pytest.fixture(scope="session")
def model_dir() -> str:
    """The converted SmolLM2 directory; the session fails if `make test-vllm` did not make it."""
    default = Path("~/.cache/tokenflow-bench/smollm2-hf").expanduser()
    path = Path(os.environ.get("TOKENFLOW_VLLM_MODEL_DIR", default))
    if not (path / "config.json").exists():
        pytest.fail(f"no converted model in {path}: run `make test-vllm`")
    return str(path)


def make_llm(model_dir: str, tokenflow: bool, host_kv: bool = False, **overrides):
    """An in-process vLLM on the CPU with the tiny pool, with our scheduler or vLLM's, and
    (`host_kv`) the host KV connector: pauses offload instead of recompute."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from tokenflow.integrations.vllm.serve import host_kv_transfer_config

    kwargs = dict(
        model=model_dir,
        dtype="float32",
        enforce_eager=True,
        num_gpu_blocks_override=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        max_model_len=96,
        max_num_seqs=8,
        seed=0,
        kv_cache_memory_bytes=64 << 20,  # the pool is overridden anyway; skip the RAM check
    )
    if tokenflow:
        kwargs.update(
            scheduler_cls=SCHEDULER_CLS, additional_config={"tokenflow": {"policy": POLICY}}
        )
    if host_kv:
        kwargs.update(kv_transfer_config=KVTransferConfig(**host_kv_transfer_config()))
    kwargs.update(overrides)
    return LLM(**kwargs)


def close_llm(llm) -> None:
    """Release an in-process engine before the next one starts."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def scheduler_of(llm):
    """The scheduler object of an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler
