"""What `TokenFlowScheduler` reads from vLLM's own `OffloadingConnector` (scheduler side).

On CUDA-alike and XPU platforms the integration keeps paused streams' KV with vLLM's native
offloading (`--kv-offloading-size`, `OffloadingConnector` with `CPUOffloadingSpec`, vLLM 0.32):

- every full block a request computes is stored to a host pool as it is computed
  (`OffloadingConnectorScheduler._build_store_jobs`, once `offload_prompt_only` is false: its
  default, true, stores prompt blocks only);
- a preempted request's stores in flight are flushed before its GPU blocks are reused
  (`build_connector_meta` puts its jobs in `jobs_to_flush`; the worker waits for them in
  `handle_preemptions`);
- when the request is scheduled again, its longest stored prefix beyond vLLM's own prefix-cache
  hit is loaded (`get_num_new_matched_tokens`, a prefix lookup that stops at the first miss);
- the pool (`CPUOffloadingManager`, `v1/kv_offload/cpu/manager.py`) holds a fixed number of
  chunks and, when a store finds none free, evicts the least recently used idle ones
  (`policies/lru.py`): recency is the store, and a finished request's keys are re-ranked as
  the newest.  Nothing pins a paused stream's chunks, and its prompt chunks are its oldest, so
  under pressure its copy is lost from the front, and a lost first chunk loses it all.

So a paused stream's copy is not guaranteed to be there when it resumes.  `held_tokens` asks the
pool, at each step before the policy decides, how many leading tokens of a request it would load
now; between that question and vLLM's own lookup in the same `schedule()` nothing is stored or
evicted (stores are planned in `build_connector_meta`, at the end of the step; a planned load
pins its chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.request import Request

CONNECTOR_NAME = "OffloadingConnector"


@dataclass(frozen=True)
class OffloadPool:
    """vLLM's host offloading pool, as the policy sees it (one KV cache group, CPU pool)."""

    connector: OffloadingConnector
    num_blocks: int  # capacity, in device-sized blocks
    block_bytes: int  # one device block, all layers, K and V
    tokens_per_chunk: int  # the pool's unit: blocks_per_chunk device blocks
    hashes_per_chunk: int  # request block hashes per chunk
    group_idx: int

    @classmethod
    def of(cls, connector: object, block_bytes: int) -> OffloadPool | None:
        """The pool behind `connector`, or None when it is not vLLM's `OffloadingConnector` with
        its CPU pool over one KV cache group (the policy then prices pauses as recomputes)."""
        if not isinstance(connector, OffloadingConnector):
            return None
        scheduler = connector.connector_scheduler
        manager = scheduler.manager if scheduler is not None else None
        if not isinstance(manager, CPUOffloadingManager):
            return None
        groups = scheduler.config.kv_group_configs
        if len(groups) != 1 or groups[0].sliding_window_size_in_chunks is not None:
            return None
        group = groups[0]
        blocks_per_chunk = scheduler.config.blocks_per_chunk
        return cls(
            connector=connector,
            num_blocks=manager._num_chunks * blocks_per_chunk,  # (no public accessor in 0.32)
            block_bytes=block_bytes,
            tokens_per_chunk=group.tokens_per_chunk,
            hashes_per_chunk=group.hashes_per_chunk,
            group_idx=group.group_idx,
        )

    @property
    def offloads_decode_blocks(self) -> bool:
        """False when the connector stores prompt blocks only (`offload_prompt_only`)."""
        return not self.connector.connector_scheduler.config.offload_prompt_only

    def held_tokens(self, request: Request) -> int:
        """Leading tokens of `request` whose KV the pool holds now, stored or being stored (a
        store in flight completes before the request can load: vLLM delays it until then)."""
        manager = self.connector.connector_scheduler.manager
        context = ReqContext(req_id=request.request_id)
        hashes = request.block_hashes
        num_chunks = 0
        for end in range(self.hashes_per_chunk - 1, len(hashes), self.hashes_per_chunk):
            key = make_offload_key(hashes[end], self.group_idx)
            result = manager.lookup(key, context)
            if result is not LookupResult.HIT and result is not LookupResult.HIT_PENDING:
                break
            num_chunks += 1
        return num_chunks * self.tokens_per_chunk
