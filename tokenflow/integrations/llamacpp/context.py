"""A thin, typed handle on one llama.cpp model and context (through llama-cpp-python's C API).

Only what the executor needs: decode a batch of (token, position, sequence, wants logits)
entries, read the logits rows, drop a sequence's positions from some point on, and save or
restore one sequence's KV as bytes.  llama.cpp's log goes to Python logging at debug level.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as llama
import numpy as np

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ContextSpec:
    """How big a context to make."""

    num_ctx_tokens: int  # KV cells, all sequences together
    max_batch_tokens: int  # tokens in one decode call
    num_seqs: int  # distinct sequence ids
    num_threads: int
    # ggml's "extra buffer types": weights repacked at load into a CPU-specific layout for its
    # AMX kernels or its AVX2/AVX-512 ones (Q4_0, Q4_K, IQ4_NL, ...), llama.cpp's default
    # (--repack).  Off, every weight stays in ggml's plain layout and kernels, which run on any
    # x86 CPU: on one reporting AMX the AMX path crashed at start-up (SIGSEGV, SIGILL with one
    # thread; as llama-server did unless given --no-repack; llama.cpp issue 20824).
    repack_weights: bool = False


class DecodeFailed(RuntimeError):
    """llama_decode refused a batch (code 1: no room in the KV cache; others: an error)."""

    def __init__(self, code: int) -> None:
        super().__init__(f"llama_decode returned {code}")
        self.code = code

    @property
    def is_out_of_room(self) -> bool:
        return self.code == 1


@llama.llama_log_callback
def _forward_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    logger.debug("llama.cpp: %s", text.decode(errors="replace").rstrip())


@functools.cache  # once per process, as llama.cpp requires
def _init_backend() -> None:
    llama.llama_log_set(_forward_log, ctypes.c_void_p(0))
    llama.llama_backend_init()


def model_params(spec: ContextSpec) -> llama.llama_model_params:
    """llama.cpp's model parameters for `spec`: its defaults, repacking as the spec says."""
    params = llama.llama_model_default_params()
    params.use_extra_bufts = spec.repack_weights
    return params


class LlamaContext:
    """One model and one context; the batch buffer is reused across calls."""

    def __init__(self, model_path: Path, spec: ContextSpec) -> None:
        _init_backend()
        self.spec = spec
        self._model = llama.llama_model_load_from_file(str(model_path).encode(), model_params(spec))
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        params = llama.llama_context_default_params()
        params.n_ctx = spec.num_ctx_tokens
        params.n_batch = spec.max_batch_tokens
        params.n_ubatch = min(512, spec.max_batch_tokens)
        params.n_seq_max = spec.num_seqs
        params.n_threads = params.n_threads_batch = spec.num_threads
        params.kv_unified = True  # one pool of cells shared by every sequence
        self._ctx = llama.llama_init_from_model(self._model, params)
        if not self._ctx:
            llama.llama_model_free(self._model)
            raise RuntimeError("llama.cpp could not create a context")
        self._memory = llama.llama_get_memory(self._ctx)
        self.vocab_size = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self._model))
        self._batch = llama.llama_batch_init(spec.max_batch_tokens, 0, 1)

    def close(self) -> None:
        """Free the batch, context and model (the handle is unusable afterwards)."""
        if self._ctx:
            llama.llama_batch_free(self._batch)
            llama.llama_free(self._ctx)
            llama.llama_model_free(self._model)
            self._ctx = None

    def decode(
        self, tokens: list[int], positions: list[int], seqs: list[int], wants_logits: list[bool]
    ) -> np.ndarray:
        """Compute the KV of every entry; the logits rows of those that want them, in order
        ([rows, vocab] float32, a copy).  DecodeFailed leaves the cache as it was."""
        n = len(tokens)
        if n > self.spec.max_batch_tokens:
            raise ValueError(f"{n} tokens in one batch; at most {self.spec.max_batch_tokens}")
        batch = self._batch
        token, pos, n_seq, seq_id, logits = (
            batch.token,
            batch.pos,
            batch.n_seq_id,
            batch.seq_id,
            batch.logits,
        )
        for i in range(n):
            token[i] = tokens[i]
            pos[i] = positions[i]
            n_seq[i] = 1
            seq_id[i][0] = seqs[i]
            logits[i] = wants_logits[i]
        batch.n_tokens = n
        code = llama.llama_decode(self._ctx, batch)
        if code != 0:
            raise DecodeFailed(code)
        rows = sum(wants_logits)
        if not rows:
            return np.empty((0, self.vocab_size), dtype=np.float32)
        pointer = llama.llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(pointer, shape=(rows, self.vocab_size)).copy()

    def num_positions(self, seq: int) -> int:
        """How many positions the sequence holds (its largest position + 1; 0 when empty)."""
        return llama.llama_memory_seq_pos_max(self._memory, seq) + 1

    def truncate(self, seq: int, keep: int) -> None:
        """Drop the sequence's positions from `keep` on (keep=0: all of it)."""
        if not llama.llama_memory_seq_rm(self._memory, seq, keep, -1):
            raise RuntimeError(f"llama.cpp could not drop positions >= {keep} of sequence {seq}")

    def save(self, seq: int) -> bytes:
        """The sequence's KV (and positions) as bytes, for `restore`."""
        size = llama.llama_state_seq_get_size(self._ctx, seq)
        buffer = (ctypes.c_uint8 * size)()
        written = llama.llama_state_seq_get_data(self._ctx, buffer, size, seq)
        if written != size:
            raise RuntimeError(f"llama.cpp saved {written} of {size} bytes of sequence {seq}")
        return bytes(buffer)

    def restore(self, seq: int, state: bytes) -> None:
        """Load bytes from `save` into the (empty) sequence; DecodeFailed(1) if no room."""
        buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if llama.llama_state_seq_set_data(self._ctx, buffer, len(state), seq) == 0:
            raise DecodeFailed(1)
