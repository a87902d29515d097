"""The offline API, vLLM's: `LLM(...).generate(prompts, SamplingParams(...))` and
`LLM(...).chat(messages)` return one `RequestOutput` per prompt, its choices in `.outputs`.

Above the engine (like the CLI): the executor is picked by `EngineArgs.executor` through
`tokenflow.integrations.executors`, so `LLM(executor="llama-cpp")` runs llama.cpp.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from tokenflow.core.plan import TokenLogprobs
from tokenflow.core.request import SamplingParams
from tokenflow.engine.client import GenerationDelta
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.engine.llm_engine import LLMEngine
from tokenflow.integrations.executors import executor_factory
from tokenflow.model.tokenizer import Tokenizer

Prompt = str | Sequence[int]
Message = Mapping[str, Any]
Conversation = Sequence[Message]
Params = SamplingParams | Sequence[SamplingParams] | None


@dataclass(frozen=True)
class Logprob:
    """vLLM's: a token's log-probability, its rank (1 = the most likely; None when it is not
    among the alternatives asked for) and its own text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's shapes: per position, the chosen token and the alternatives by token id.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(frozen=True)
class CompletionOutput:
    """One choice of a request (vLLM's): `cumulative_logprob` and `logprobs` are set when the
    request asks for logprobs (`SamplingParams.logprobs`), None otherwise."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


def _moved_to_outputs(name: str) -> property:
    """A top-level reading of the first choice's `name`, kept for one release: it warns."""

    def read(self: RequestOutput) -> Any:
        warnings.warn(
            f"RequestOutput.{name} is deprecated; read .outputs[0].{name} (vLLM's shape)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(self.outputs[0], name)

    return property(read, doc=f"Deprecated: `.outputs[0].{name}`.")


@dataclass(frozen=True)
class RequestOutput:
    """One prompt's result (vLLM's): the prompt (its text, None for a token-id prompt), its
    token ids, its logprobs when asked (`SamplingParams.prompt_logprobs`) and the choices."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    text = _moved_to_outputs("text")
    token_ids = _moved_to_outputs("token_ids")
    finish_reason = _moved_to_outputs("finish_reason")


class LLM:
    """A real engine for batch generation; `LLM()` runs the embedded SmolLM2.  Every keyword
    is an `EngineArgs` field; `executor` ("torch" or "llama-cpp") picks what runs the model."""

    def __init__(self, model: str | None = None, policy: str = "tokenflow", **kwargs: Any) -> None:
        args = EngineArgs(model=model, policy=policy, **kwargs)
        self.engine = LLMEngine(args, executor_factory(args.executor))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: Params = None,
        use_tqdm: bool = False,
        *,
        rate_tps: float | None = None,
        session_key: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string or token ids, or a list of them); one output
        per prompt, in prompt order.  `sampling_params` is one for all or one per prompt;
        `rate_tps` is every request's reading rate; `session_key` (OpenAI's
        `prompt_cache_key`) is every prompt's session hint."""
        batch = _as_batch(prompts)
        encoded = [
            _Encoded(p, self.tokenizer.encode(p)) if isinstance(p, str) else _Encoded(None, list(p))
            for p in batch
        ]
        return self._run(encoded, sampling_params, use_tqdm, rate_tps, session_key)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: Params = None,
        use_tqdm: bool = False,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        rate_tps: float | None = None,
        session_key: str | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of role/content messages) or to each
        of a list of them, through the model's chat template; one output per conversation,
        whose `prompt` is the rendered template.  The template options are vLLM's (and
        `Tokenizer.render_chat`'s); the other arguments are `generate`'s."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        options: dict[str, Any] = {
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "chat_template_kwargs": chat_template_kwargs,
        }
        encoded = [
            _Encoded(
                self.tokenizer.render_chat(conversation, **options),
                self.tokenizer.apply_chat_template(conversation, **options),
            )
            for conversation in _as_conversations(messages)
        ]
        return self._run(encoded, sampling_params, use_tqdm, rate_tps, session_key)

    def _run(
        self,
        prompts: list[_Encoded],
        sampling_params: Params,
        use_tqdm: bool,
        rate_tps: float | None,
        session_key: str | None,
    ) -> list[RequestOutput]:
        """Queue every prompt, step the engine until all have ended, and collect them."""
        params_list = _params_per_prompt(sampling_params, len(prompts))
        collected: dict[str, _Collected] = {}
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                request_id = f"offline-{self._counter}"
                self._counter += 1
                self.engine.add_request(
                    request_id, prompt.token_ids, params, rate_tps, session_key=session_key
                )
                collected[request_id] = _Collected(prompt)
        except ValueError:  # a prompt that cannot run: the batch is refused whole
            for request_id in collected:
                self.engine.abort(request_id)
            raise
        bar = tqdm(total=len(collected), disable=not use_tqdm, desc="generate")
        while self.engine.has_work:
            _, deltas = self.engine.step()
            for delta in deltas:
                collected[delta.request_id].add(delta)
                if delta.finish_reason is not None:
                    bar.update(1)
        bar.close()
        return [c.output(request_id, self.tokenizer) for request_id, c in collected.items()]


@dataclass(frozen=True)
class _Encoded:
    """A prompt as given (its text; None for token ids) and the token ids it runs as."""

    text: str | None
    token_ids: list[int]


@dataclass
class _Collected:
    """One request's deltas so far, joined."""

    prompt: _Encoded
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0

    def add(self, delta: GenerationDelta) -> None:
        self.texts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finish_reason = delta.finish_reason
        self.num_cached_tokens = delta.num_cached_tokens

    def output(self, request_id: str, tokenizer: Tokenizer) -> RequestOutput:
        """The request's `RequestOutput`; logprobs only where the request asked for them."""
        asked = self.logprobs or None
        choice = CompletionOutput(
            index=0,
            text="".join(self.texts),
            token_ids=self.token_ids,
            cumulative_logprob=sum(t.logprob for t in self.logprobs) if asked else None,
            logprobs=[_position(t, tokenizer) for t in self.logprobs] if asked else None,
            finish_reason=self.finish_reason,
        )
        prompt_logprobs = None
        if self.prompt_logprobs is not None:
            prompt_logprobs = [
                None if t is None else _position(t, tokenizer) for t in self.prompt_logprobs
            ]
        return RequestOutput(
            request_id=request_id,
            prompt=self.prompt.text,
            prompt_token_ids=self.prompt.token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=[choice],
            finished=self.finish_reason is not None,
            num_cached_tokens=self.num_cached_tokens,
        )


def _position(token: TokenLogprobs, tokenizer: Tokenizer) -> dict[int, Logprob]:
    """One position's logprobs in vLLM's shape: the chosen token first, then the alternatives
    most likely first, each with its rank and its own text."""
    ranks = {token_id: i + 1 for i, token_id in enumerate(token.top_token_ids)}
    entries = {token.token_id: token.logprob}
    for token_id, logprob in zip(token.top_token_ids, token.top_logprobs, strict=True):
        entries.setdefault(token_id, logprob)
    return {
        token_id: Logprob(logprob, ranks.get(token_id), tokenizer.decode([token_id]))
        for token_id, logprob in entries.items()
    }


def _params_per_prompt(sampling_params: Params, num_prompts: int) -> list[SamplingParams]:
    params = sampling_params if sampling_params is not None else SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * num_prompts
    if len(params) != num_prompts:
        raise ValueError(f"{num_prompts} prompts but {len(params)} sampling params")
    return list(params)


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):  # one token-id prompt
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _as_conversations(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    """A list of conversations: `messages` itself when its items are conversations, else
    `messages` as the one conversation."""
    if messages and not isinstance(messages[0], Mapping):
        return list(messages)  # type: ignore[arg-type]
    return [messages]  # type: ignore[list-item]
