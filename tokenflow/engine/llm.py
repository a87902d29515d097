"""Offline generation, shaped like vLLM's: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from tokenflow.core.request import SamplingParams
from tokenflow.engine.build import ExecutorFactory, build_torch_executor
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.engine.llm_engine import LLMEngine

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class CompletionOutput:
    """One prompt's result."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None


class LLM:
    """A real engine for batch generation; `LLM()` uses the embedded SmolLM2."""

    def __init__(
        self,
        model: str | None = None,
        policy: str = "tokenflow",
        build_executor: ExecutorFactory = build_torch_executor,
        **kwargs: Any,
    ) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, policy=policy, **kwargs), build_executor)
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        rate_tps: float | None = None,
        use_tqdm: bool = False,
        session_key: str | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (strings or token-id lists); results in prompt order.
        `session_key` (OpenAI's `prompt_cache_key`) is every prompt's session hint."""
        batch = _as_batch(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = [params] * len(batch) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(params_list)} sampling params")
        order: list[str] = []
        texts: dict[str, str] = {}
        tokens: dict[str, list[int]] = {}
        finish: dict[str, str | None] = {}
        prompt_ids: dict[str, list[int]] = {}
        for prompt, p in zip(batch, params_list, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = f"offline-{self._counter}"
            self._counter += 1
            self.engine.add_request(request_id, ids, p, rate_tps, session_key=session_key)
            order.append(request_id)
            texts[request_id], tokens[request_id], prompt_ids[request_id] = "", [], ids
        bar = tqdm(total=len(order), disable=not use_tqdm, desc="generate")
        while self.engine.has_work:
            _, deltas = self.engine.step()
            for d in deltas:
                texts[d.request_id] += d.text
                tokens[d.request_id].extend(d.token_ids)
                if d.finish_reason is not None:
                    finish[d.request_id] = d.finish_reason
                    bar.update(1)
        bar.close()
        return [
            CompletionOutput(
                rid,
                prompt if isinstance(prompt, str) else None,
                prompt_ids[rid],
                tokens[rid],
                texts[rid],
                finish.get(rid),
            )
            for rid, prompt in zip(order, batch, strict=True)
        ]


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):  # one token-id prompt
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]
