"""Weight repacking (ggml's extra buffer types) reaches llama.cpp only when asked: from the
engine's flag to the context spec, and from the spec to llama.cpp's model parameters."""

from __future__ import annotations

import pytest

from tokenflow.engine.engine_args import EngineArgs
from tokenflow.integrations import llamacpp
from tokenflow.integrations.llamacpp import context, executor
from tokenflow.integrations.llamacpp.context import ContextSpec


def spec(repack_weights: bool) -> ContextSpec:
    return ContextSpec(
        num_ctx_tokens=64,
        max_batch_tokens=8,
        num_seqs=1,
        num_threads=1,
        repack_weights=repack_weights,
    )


def test_the_executor_loads_the_model_with_the_specs_repacking(gguf, monkeypatch):
    path, config, _ = gguf
    seen = []

    def load(model_path: bytes, params: object) -> None:
        seen.append(params.use_extra_bufts)
        return None  # "could not load": nothing runs, whatever the CPU

    monkeypatch.setattr(context.llama, "llama_model_load_from_file", load)
    for repack in (False, True):
        with pytest.raises(RuntimeError, match="could not load"):
            executor.LlamaCppExecutor(path, spec(repack), config.eos_token_ids)
    assert seen == [False, True]
    assert not ContextSpec(64, 8, 1, 1).repack_weights  # off by default


def test_the_engines_flag_reaches_the_spec(gguf, monkeypatch):
    path, config, _ = gguf
    specs = []
    monkeypatch.setattr(executor, "LlamaCppExecutor", lambda _, spec, *rest: specs.append(spec))
    for repack in (False, True):
        args = EngineArgs(executor="llama-cpp", llama_cpp_repack=repack)
        llamacpp.build_executor(path, config, args, pool_tokens=1024)
    assert [s.repack_weights for s in specs] == [False, True]
