"""An executor that runs the core's plans on llama.cpp (ggml's low-bit CPU kernels).

The scheduler, policies and tiers are the core's, unchanged; only the forward pass and the KV
storage are llama.cpp's.  The core's device blocks remain its accounting of device memory:
llama.cpp keeps each sequence's KV in one shared pool of cells (sized like the device tier),
so the plan's block copies have nothing to move.  Instead, the executor keeps whole sequences:

- a request's sequence lives in llama.cpp's pool while the pool has room.  Its KV is truncated
  to each chunk's `start_position` before the chunk runs, which makes a resume by recompute
  (the core starts the chunk earlier) and a resume by load (later) both exact;
- when the pool is full (a decode or restore finds no room, or no sequence id is free), the
  least recently scheduled sequence not in the plan is saved to host memory as bytes and
  dropped from the pool; its request's next chunk restores it into a fresh sequence.

So every plan runs to the letter of the step rules in `tokenflow.core.plan` (KV of the chunks'
tokens at their positions, one sampled token per sampling chunk, in chunk order), and the
sampling is the torch engine's (`Sampler`, seeded per request) on llama.cpp's logits.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from tokenflow.core.plan import SampledToken, ScheduledChunk, StepPlan, StepResult
from tokenflow.integrations.llamacpp.context import ContextSpec, DecodeFailed, LlamaContext
from tokenflow.model.sampler import Sampler, SamplingRow, sample_isolated


class LlamaCppExecutor:
    """Runs plans against llama.cpp, keeping whole sequences (see the module docstring)."""

    def __init__(
        self, model_path: Path, spec: ContextSpec, eos_token_ids: tuple[int, ...], seed: int = 0
    ) -> None:
        self.context = LlamaContext(model_path, spec)
        self.sampler = Sampler(eos_token_ids, seed=seed)
        self._live: OrderedDict[str, int] = OrderedDict()  # request -> sequence, oldest use first
        self._saved: dict[str, bytes] = {}  # request -> its sequence's KV, out of the pool
        self._free_seqs = list(range(spec.num_seqs - 1, -1, -1))
        self.num_saves = 0  # sequences moved out of the pool to make room
        self.num_restores = 0

    def close(self) -> None:
        """Free llama.cpp's model and context (the executor is unusable afterwards)."""
        self.context.close()

    def execute(self, plan: StepPlan) -> StepResult:
        """Run the plan's chunks in one llama_decode call; sample; return the tokens (a row
        whose sampling fails gets a placeholder and is named in the result's `failed_rows`)."""
        for request_id in plan.released_request_ids:
            self._forget(request_id)
        if not plan.chunks:
            return StepResult(sampled=())
        in_plan = {chunk.request_id for chunk in plan.chunks}
        if len(in_plan) != len(plan.chunks):
            raise ValueError("a plan holds two chunks of one request")
        tokens: list[int] = []
        positions: list[int] = []
        seqs: list[int] = []
        wants: list[bool] = []
        for chunk in plan.chunks:
            seq = self._place(chunk.request_id, chunk.start_position, in_plan)
            n = len(chunk.token_ids)
            tokens.extend(chunk.token_ids)
            positions.extend(range(chunk.start_position, chunk.start_position + n))
            seqs.extend([seq] * n)
            wants.extend([False] * (n - 1))
            wants.append(chunk.samples_token)
        logits = self._decode(tokens, positions, seqs, wants, in_plan)
        failed_rows: dict[str, str] = {}  # request id -> why its row failed
        sampled = self._sample(plan.chunks, logits, failed_rows)
        return StepResult(sampled=sampled, failed_rows=failed_rows)

    def _sample(
        self, chunks: tuple[ScheduledChunk, ...], logits: np.ndarray, failed_rows: dict[str, str]
    ) -> tuple[SampledToken, ...]:
        sampling = [c for c in chunks if c.samples_token]
        rows = [SamplingRow(c.request_id, c.sampling_params, c.num_output_tokens) for c in sampling]
        token_ids = sample_isolated(self.sampler, torch.from_numpy(logits), rows, failed_rows)
        return tuple(
            SampledToken(c.request_id, token_id)
            for c, token_id in zip(sampling, token_ids, strict=True)
        )

    # -- sequences ---------------------------------------------------------------------------------
    def _place(self, request_id: str, start: int, busy: set[str]) -> int:
        """The request's sequence, holding exactly its positions [0, start)."""
        seq = self._live.get(request_id)
        if seq is not None:
            self._live.move_to_end(request_id)
        else:
            seq = self._take_seq(busy)
            saved = self._saved.pop(request_id, None)
            if start > 0:
                if saved is None:
                    self._free_seqs.append(seq)
                    raise RuntimeError(
                        f"request {request_id} continues at position {start}, "
                        "but its KV was never computed"
                    )
                self._restore(seq, saved, busy)
            self._live[request_id] = seq
        held = self.context.num_positions(seq)
        if held < start:
            raise RuntimeError(
                f"request {request_id} continues at position {start}, but its KV holds {held}"
            )
        if held > start:
            self.context.truncate(seq, start)
        return seq

    def _take_seq(self, busy: set[str]) -> int:
        if not self._free_seqs and not self._save_one(busy):
            raise RuntimeError("every llama.cpp sequence id is in use by this plan")
        return self._free_seqs.pop()

    def _restore(self, seq: int, saved: bytes, busy: set[str]) -> None:
        while True:
            try:
                self.context.restore(seq, saved)
                self.num_restores += 1
                return
            except DecodeFailed:
                if not self._save_one(busy):
                    raise

    def _decode(
        self,
        tokens: list[int],
        positions: list[int],
        seqs: list[int],
        wants: list[bool],
        busy: set[str],
    ) -> np.ndarray:
        while True:
            try:
                return self.context.decode(tokens, positions, seqs, wants)
            except DecodeFailed as err:
                if not (err.is_out_of_room and self._save_one(busy)):
                    raise

    def _save_one(self, busy: set[str]) -> bool:
        """Move the least recently scheduled sequence outside `busy` to host memory; False if
        every live sequence is busy."""
        victim = next((r for r in self._live if r not in busy), None)
        if victim is None:
            return False
        seq = self._live.pop(victim)
        self._saved[victim] = self.context.save(seq)
        self.context.truncate(seq, 0)
        self._free_seqs.append(seq)
        self.num_saves += 1
        return True

    def _forget(self, request_id: str) -> None:
        self._saved.pop(request_id, None)
        seq = self._live.pop(request_id, None)
        if seq is not None:
            self.context.truncate(seq, 0)
            self._free_seqs.append(seq)
