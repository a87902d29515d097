"""The real executor: one `StepPlan` in, one `StepResult` out (see tokenflow.core.plan).

On CUDA a step overlaps its tier copies with its forward pass: the copies run on a worker
thread, on a dedicated copy stream that first waits for the KV writes of earlier steps, while
the forward runs on the calling thread.  The plan guarantees that no copy touches a block the
forward writes, and the worker is joined (and the copy stream synchronised) before `execute`
returns, so every copy of a plan is complete when its result is.  On CPU the copies run first,
on the calling thread: both tiers are the same memory and the forward's threads take every
core, so a concurrent copy only takes one from them (what each costs: docs/design.md, "The KV
tiers").

Failure isolation: when sampling a batch raises, the rows are sampled one by one and only the
rows that still fail are given up, as is a row whose token its grammar refuses: they get a
placeholder token and are named in the result's `failed_rows` (request id -> reason), and the
core ends those requests with an error (tokenflow.core.plan, step semantics 5).  A failing
forward pass or copy raises: the whole plan failed.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tokenflow.core.plan import BlockTables, SampledToken, ScheduledChunk, StepPlan, StepResult
from tokenflow.core.request import SamplingParams
from tokenflow.model.attention import ModelInputs, build_model_inputs
from tokenflow.model.compiled_decode import CompiledDecoder
from tokenflow.model.config import ModelConfig
from tokenflow.model.decode_path import (
    ALL_ROWS,
    DecodePathChoice,
    DecodePathSettings,
    StepRunner,
    choose_decode_path,
)
from tokenflow.model.grammar import Grammars
from tokenflow.model.kv_cache import TieredKVCache
from tokenflow.model.logprobs import PromptLogprobs, sampled_logprobs, wants_prompt_logprobs
from tokenflow.model.paged_decode import MIN_KEYS, can_read_in_place
from tokenflow.model.penalties import TokenCounts
from tokenflow.model.sampler import Sampler, SamplingRow, sample_isolated
from tokenflow.model.threads import StepThreads
from tokenflow.model.transformer import LlamaModel

logger = logging.getLogger(__name__)
# The start-up timing of decode paths runs steps of this many context tokens per stream.
PROBE_CONTEXT_TOKENS = 64
_GREEDY = SamplingParams(temperature=0.0)


class ModelExecutor:
    """Runs plans against a model and a tiered KV cache."""

    def __init__(
        self,
        model: LlamaModel,
        config: ModelConfig,
        kv_cache: TieredKVCache,
        device: torch.device | str,
        seed: int = 0,
        compile_decode: bool | None = False,
        serial_below_tokens: int = 0,
        grammars: Grammars | None = None,
        decode_settings: DecodePathSettings | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.sampler = Sampler(config.eos_token_ids, seed=seed)
        self.grammars = grammars  # structured outputs' matchers (None: not supported)
        self.token_counts = TokenCounts(config.vocab_size, self.device)  # for penalties
        self.prompt_logprobs = PromptLogprobs()
        is_cuda = self.device.type == "cuda"
        # On CUDA only, the copies' worker and stream (copies overlap the forward there)
        self._copier = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-copy") if is_cuda else None
        )
        self._copy_stream = torch.cuda.Stream(self.device) if is_cuda else None
        self.block_tables = BlockTables()  # every request's device table, from the plans' deltas
        # On CPU decode attention reads the paged KV in place (a compiled kernel); on CUDA, and
        # where compiling fails, it gathers the blocks for SDPA.
        layer = kv_cache.device_layers[0]
        reads_in_place = not is_cuda and can_read_in_place(layer.key, layer.value, config.num_heads)
        self.in_place_min_keys = MIN_KEYS if reads_in_place else None
        # On CPU, tiny steps compute on one thread (threads.py); CUDA steps are not affected.
        self.threads = None if is_cuda else StepThreads(serial_below_tokens)
        # Decode-only steps may run through compiled graphs (compiled_decode.py): always or
        # never as `compile_decode` says, or (None) up to the batch where they measured faster
        # on this machine (decode_path.py; eager on CUDA and without `decode_settings`).
        self.decoder: CompiledDecoder | None = None
        self.decode_path = DecodePathChoice(0, "flags")
        if compile_decode:
            self.decoder = _compiled_decoder(model, kv_cache, reads_in_place)
            self.decode_path = DecodePathChoice(ALL_ROWS, "flags")
        elif compile_decode is None and decode_settings is not None and not is_cuda:
            self._choose_decode_path(decode_settings, reads_in_place)

    def _choose_decode_path(self, settings: DecodePathSettings, reads_in_place: bool) -> None:
        """Set `decoder` and `decode_path` from the cached choice, else by timing both paths
        (compiling first); eager wherever compiling fails."""

        def compile_and_time() -> StepRunner | None:
            self.decoder = _compiled_decoder(self.model, self.kv_cache, reads_in_place)
            return None if self.decoder is None else self._time_decode_step

        choice = choose_decode_path(settings, compile_and_time)
        if choice.compiled_max_rows and self.decoder is None:  # cached: warm the compiler up
            self.decoder = _compiled_decoder(self.model, self.kv_cache, reads_in_place)
        if self.decoder is None:
            choice = dataclasses.replace(choice, compiled_max_rows=0)
        elif not choice.compiled_max_rows:
            self.decoder = None
        self.decode_path = choice
        logger.info("%s", choice.describe())

    def _time_decode_step(self, rows: int, compiled: bool) -> None:
        """One decode step of `rows` streams of PROBE_CONTEXT_TOKENS (start-up timing only:
        nothing is allocated, the K/V written lands in blocks no request holds yet)."""
        block_size = self.kv_cache.block_size
        blocks_per_seq = -(-PROBE_CONTEXT_TOKENS // block_size)
        num_blocks = self.kv_cache.num_device_blocks
        tables = {
            f"probe-{i}": [(i * blocks_per_seq + b) % num_blocks for b in range(blocks_per_seq)]
            for i in range(rows)
        }
        chunks = [
            ScheduledChunk(request_id, (0,), PROBE_CONTEXT_TOKENS - 1, (), 0, True, _GREEDY, 1)
            for request_id in tables
        ]
        with torch.inference_mode():
            inputs = build_model_inputs(
                chunks, tables, block_size, self.device, self.in_place_min_keys
            )
            if self.threads is not None:
                self.threads.for_step(rows)
            attn, layers = inputs.attn, self.kv_cache.device_layers
            if compiled and self.decoder is not None and attn.decode is not None:
                self.decoder.forward(
                    inputs.input_ids, inputs.positions, attn.slot_mapping, attn.decode, layers
                )
            else:
                self.model(inputs.input_ids, inputs.positions, attn, layers)

    def close(self) -> None:
        """Stop the copy worker, if any (the executor is unusable afterwards)."""
        if self._copier is not None:
            self._copier.shutdown(wait=True)

    def execute(self, plan: StepPlan) -> StepResult:
        """Run the plan's copies (concurrently with the forward on CUDA, before it on CPU) and
        forward pass; sample; return the tokens."""
        self.token_counts.release(plan.released_request_ids)
        self.prompt_logprobs.release(plan.released_request_ids)
        if self.grammars is not None:
            self.grammars.release(plan.released_request_ids)
        self.block_tables.apply(plan)
        failed_rows: dict[str, str] = {}  # request id -> why its row failed
        copies = self._start_copies(plan)
        try:
            sampled = self._forward_and_sample(plan, failed_rows)
        finally:
            if copies is not None:
                copies.result()  # joins the worker; re-raises a copy failure
        return StepResult(sampled=sampled, failed_rows=failed_rows)

    def _start_copies(self, plan: StepPlan) -> Future[None] | None:
        """The plan's copies: done here on CPU (None), else started on the copy worker."""
        if not (plan.device_to_host or plan.host_to_device):
            return None
        if self._copier is None:  # CPU
            with torch.inference_mode():
                self.kv_cache.apply_copies(plan.device_to_host, plan.host_to_device)
            return None
        # Copies may read blocks that earlier forwards wrote on the compute stream.
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        return self._copier.submit(self._run_copies, plan, ready)

    def _run_copies(self, plan: StepPlan, ready: torch.cuda.Event) -> None:
        with torch.inference_mode():
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(ready)
                self.kv_cache.apply_copies(plan.device_to_host, plan.host_to_device)
            self._copy_stream.synchronize()

    def _forward_and_sample(
        self, plan: StepPlan, failed_rows: dict[str, str]
    ) -> tuple[SampledToken, ...]:
        if not plan.chunks:
            return ()
        with torch.inference_mode():
            inputs = build_model_inputs(
                plan.chunks,
                self.block_tables,
                self.kv_cache.block_size,
                self.device,
                self.in_place_min_keys,
            )
            if self.threads is not None:
                self.threads.for_step(len(inputs.input_ids))
            scored = [i for i, c in enumerate(plan.chunks) if wants_prompt_logprobs(c)]
            extra_rows = [
                row
                for i in scored
                for row in PromptLogprobs.rows_of(plan.chunks[i], inputs.chunk_last_rows[i])
            ]
            logits = self._forward(inputs, extra_rows)  # [num_sampled + len(extra_rows), vocab]
            num_sampled = len(inputs.sampled_chunk_indices)
            self._record_prompt_logprobs([plan.chunks[i] for i in scored], logits[num_sampled:])
            self.token_counts.observe(plan.chunks)
            chunks = [plan.chunks[i] for i in inputs.sampled_chunk_indices]
            return self._sample(chunks, logits[:num_sampled], failed_rows)

    def _sample(
        self, chunks: list[ScheduledChunk], logits: torch.Tensor, failed_rows: dict[str, str]
    ) -> tuple[SampledToken, ...]:
        """One token per sampling chunk (logits [len(chunks), vocab], raw), with the logprobs
        of the requests that ask for them (of the model's raw distribution, before penalties and
        grammar masks, as vLLM reports them by default); the rows that failed go in
        `failed_rows`, each with a placeholder token."""
        rows = [
            SamplingRow(
                c.request_id,
                c.sampling_params,
                c.num_output_tokens,
                self.token_counts.get(c.request_id),
            )
            for c in chunks
        ]
        params = [c.sampling_params for c in chunks]
        raw, grammars, request_ids = logits, self.grammars, [c.request_id for c in chunks]
        if grammars is not None:  # a constrained row is masked by its grammar first
            if any(p.logprobs is not None for p in params):
                raw = logits.clone()  # (the mask writes in place; logprobs are the raw model's)
            grammars.mask(logits, request_ids, params)
        token_ids = sample_isolated(self.sampler, logits, rows, failed_rows)
        if grammars is not None:  # once the batch is sampled: the sampler may retry a row
            grammars.accept(request_ids, token_ids, failed_rows)
        logprobs = sampled_logprobs(raw, params, token_ids)
        return tuple(
            SampledToken(
                c.request_id,
                token_id,
                token_logprobs,
                self.prompt_logprobs.take(c.request_id) if wants_prompt_logprobs(c) else None,
            )
            for c, token_id, token_logprobs in zip(chunks, token_ids, logprobs, strict=True)
        )

    def _record_prompt_logprobs(self, chunks: list[ScheduledChunk], logits: torch.Tensor) -> None:
        """logits [rows of `chunks`' prompt logprobs, in their order, vocab]."""
        offset = 0
        for chunk in chunks:
            num_rows = chunk.num_tokens - 1 if chunk.samples_token else chunk.num_tokens
            self.prompt_logprobs.record(chunk, logits[offset : offset + num_rows])
            offset += num_rows

    def _forward(self, inputs: ModelInputs, extra_rows: list[int] | None = None) -> torch.Tensor:
        """The logits of the sampled rows, then of `extra_rows` (prompt logprobs)."""
        attn, layers = inputs.attn, self.kv_cache.device_layers
        if extra_rows:
            rows = torch.tensor(extra_rows, dtype=torch.long, device=attn.sample_rows.device)
            attn = dataclasses.replace(attn, sample_rows=torch.cat([attn.sample_rows, rows]))
            return self.model(inputs.input_ids, inputs.positions, attn, layers)
        decode = attn.decode
        is_decode_only = decode is not None and not attn.prefills
        if (
            self.decoder is not None
            and is_decode_only
            and len(attn.sample_rows) == decode.num_seqs
            and self.decode_path.uses_compiled(decode.num_seqs)
        ):
            return self.decoder.forward(
                inputs.input_ids, inputs.positions, attn.slot_mapping, decode, layers
            )
        return self.model(inputs.input_ids, inputs.positions, attn, layers)


def _compiled_decoder(
    model: LlamaModel, kv_cache: TieredKVCache, reads_in_place: bool
) -> CompiledDecoder | None:
    """A warmed-up CompiledDecoder, or None (with a warning) when compiling fails."""
    decoder = CompiledDecoder(model)
    try:
        with torch.inference_mode():
            decoder.warm_up(kv_cache.device_layers, reads_in_place)
    except Exception as err:  # noqa: BLE001 - any compiler failure means: stay eager
        logger.warning("compiled decode steps unavailable (%s); running them eagerly", err)
        return None
    return decoder
