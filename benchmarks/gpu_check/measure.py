"""The measuring stage of `python -m benchmarks.gpu_check`, on one CUDA device: engine
throughput, host <-> device copies, and the simulator's H200 preset against both.  Writes one
JSON file.

    python3 -m benchmarks.gpu_check.measure --out measure.json [--model-dir DIR --tokenizer-dir TOK]

- **Throughput** of the engine's executor (`ModelExecutor`, bfloat16, paged KV) through
  `tokenflow.calibrate.sweep.run_sweep`: decode tokens/s at 1, 32 and 128 streams (each at a
  context of
  512 tokens) and prefill tokens/s (chunks of 512 and 2,048 tokens), for two shapes with random
  weights (step times do not depend on the values): SmolLM2-135M, the model the project
  embeds, and Llama-3-8B, the largest of the simulator's models (`tokenflow/sim/hardware.py`)
  that one GPU holds with room for its KV.
- **Copies**, pinned host memory: the engine's own path per block (all layers of a block in one
  `index_select` + copy per tier tensor, `run_sweep`'s copy points), one layer piece at a time
  (K or V of one layer of one block: the layer-major copies of vLLM and SGLang, which the
  simulator charges, `cost_model.py`), and one large contiguous copy each way (the link).
- **Preset**: `CostModel(get_gpu("H200"), shape)` predicts each measured point; the ratios and
  the constants the measurements imply (step overhead, achieved FLOP/s and HBM share, PCIe
  bandwidth, copy latency) say which of the preset's constants are off, and by how much.
- With `--model-dir`, also writes a SmolLM2-135M-shaped checkpoint (random bfloat16 weights,
  the tokenizer files of `--tokenizer-dir`) there, for the served stages of the check.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenflow.calibrate.sweep import SweepSpec, run_sweep
from tokenflow.core.plan import attention_pairs
from tokenflow.engine import ModelExecutor
from tokenflow.model import LlamaModel, ModelConfig, TieredKVCache
from tokenflow.sim.cost_model import CostModel
from tokenflow.sim.hardware import ModelSpec, get_gpu

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Sizes:
    """The points measured, and where."""

    device: str = "cuda"
    context: int = 512  # tokens each decoding stream attends to
    decode_batches: tuple[int, ...] = (1, 32, 128)
    prefill_tokens: tuple[int, ...] = (512, 2048)
    copy_blocks: tuple[int, ...] = (1, 64)

    @property
    def num_device_blocks(self) -> int:
        decode = max(self.decode_batches) * self.context // BLOCK_SIZE
        return decode + max(self.prefill_tokens) // BLOCK_SIZE

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


# `--smoke`: the same code on this CPU, tiny points, in seconds (no figure worth reading).
SMOKE = Sizes(device="cpu", context=32, decode_batches=(1, 2), prefill_tokens=(16, 32),
              copy_blocks=(1, 4))  # fmt: skip
# transformers config.json fields of the two shapes (HuggingFaceTB/SmolLM2-135M-Instruct and
# meta-llama/Meta-Llama-3-8B).
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        model_type="llama", num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
        num_key_value_heads=3, intermediate_size=1536, vocab_size=49152, rope_theta=100000.0,
        rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    ),
    "llama3-8b": dict(
        model_type="llama", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
        rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001,
    ),
}  # fmt: skip


def random_executor(raw: dict[str, Any], sizes: Sizes) -> tuple[ModelExecutor, ModelConfig]:
    """The engine's executor over a model of this shape with random bfloat16 weights."""
    config = ModelConfig.from_hf_config(raw)
    model = LlamaModel.empty(config, torch.device(sizes.device), torch.bfloat16)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02)
    num_host = max(sizes.copy_blocks)
    cache = TieredKVCache(
        config, sizes.num_device_blocks, num_host, BLOCK_SIZE, sizes.device, torch.bfloat16
    )
    return ModelExecutor(model, config, cache, sizes.device), config


def sweep(executor: ModelExecutor, sizes: Sizes) -> list[Any]:
    """Decode, prefill and copy points, each 2 warm-up steps and 5 timed ones (`execute`
    returns once the step's tokens and copies are done)."""
    spec = SweepSpec(
        decode_batches=sizes.decode_batches, decode_contexts=(sizes.context,),
        prefill_tokens=sizes.prefill_tokens, prefill_starts=(0,), mixed_decodes=(),
        copy_blocks=sizes.copy_blocks, warmup_steps=2, repeats=5, rounds=1,
    )  # fmt: skip
    tiers = (BLOCK_SIZE, sizes.num_device_blocks, max(sizes.copy_blocks))
    return run_sweep(executor, time.perf_counter, spec, tiers)


def median_s(samples: list[Any], **shape: int) -> float:
    durations = sorted(
        s.duration_s for s in samples if all(getattr(s, k) == v for k, v in shape.items())
    )
    return durations[len(durations) // 2]


def throughput(name: str, preset: CostModel, sizes: Sizes) -> dict[str, Any]:
    """Decode and prefill tokens/s of one shape, the copy path per block, and the preset's
    prediction of each."""
    executor, config = random_executor(SHAPES[name], sizes)
    samples = sweep(executor, sizes)
    rows: dict[str, Any] = {"decode": {}, "prefill": {}, "copy_per_block_s": {}}
    for b in sizes.decode_batches:
        step_s = median_s(samples, num_decode_seqs=b, num_prefill_tokens=0, num_h2d_blocks=0,
                          num_d2h_blocks=0)  # fmt: skip
        predicted_s = preset.compute_time_s(0, 0, b * sizes.context, b)
        rows["decode"][str(b)] = _point(b / step_s, b / predicted_s, step_s, predicted_s)
    for t in sizes.prefill_tokens:
        step_s = median_s(samples, num_prefill_tokens=t, num_decode_seqs=0)
        predicted_s = preset.compute_time_s(t, attention_pairs(0, t), 0, 0, 1)
        rows["prefill"][str(t)] = _point(t / step_s, t / predicted_s, step_s, predicted_s)
    block_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * BLOCK_SIZE * 2
    for direction, field in (("d2h", "num_d2h_blocks"), ("h2d", "num_h2d_blocks")):
        few, many = sizes.copy_blocks[0], sizes.copy_blocks[-1]
        step_s = {k: median_s(samples, **{field: k}, num_decode_seqs=0, num_prefill_tokens=0)
                  for k in (few, many)}  # fmt: skip
        per_block_s = (step_s[many] - step_s[few]) / (many - few)
        rows["copy_per_block_s"][direction] = {
            "measured": per_block_s,
            "bytes_per_s": block_bytes / per_block_s if per_block_s > 0 else None,
            "preset": preset.block_copy_time_s(block_bytes),
            "one_block_step_s": step_s[few],
        }
    rows["block_bytes"] = block_bytes
    del executor
    if sizes.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def _point(tps: float, preset_tps: float, step_s: float, preset_s: float) -> dict[str, float]:
    return {
        "tokens_per_s": tps,
        "preset_tokens_per_s": preset_tps,
        "step_s": step_s,
        "preset_step_s": preset_s,
        "measured_over_preset": tps / preset_tps,
    }


def _timed(fn: Any, sizes: Sizes, repeats: int = 10) -> float:
    fn()
    sizes.sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sizes.sync()
    return (time.perf_counter() - start) / repeats


def copy_pieces(raw: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    """Pinned copies one layer piece at a time (K or V of one layer of one block), and one large
    contiguous copy each way: seconds per piece, bytes/s."""
    config = ModelConfig.from_hf_config(raw)
    num_blocks = max(sizes.copy_blocks)
    shape = (config.num_layers, 2, num_blocks, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    device = torch.randn(shape, device=sizes.device, dtype=torch.bfloat16)
    pinned = sizes.device == "cuda"
    host = torch.empty(shape, dtype=torch.bfloat16, pin_memory=pinned)
    piece_bytes = device[0, 0, 0].numel() * 2
    num_pieces = config.num_layers * 2 * num_blocks

    def pieces(to_host: bool) -> None:
        for layer in range(config.num_layers):
            for kv in range(2):
                for block in range(num_blocks):
                    src, dst = (device, host) if to_host else (host, device)
                    dst[layer, kv, block].copy_(src[layer, kv, block], non_blocking=True)

    result: dict[str, Any] = {"piece_bytes": piece_bytes}
    for name, to_host in (("d2h", True), ("h2d", False)):
        seconds = _timed(lambda t=to_host: pieces(t), sizes, repeats=3) / num_pieces
        whole = _timed(lambda t=to_host: (host if t else device).copy_(
            device if t else host, non_blocking=True), sizes)  # fmt: skip
        result[name] = {
            "per_piece_s": seconds,
            "piece_bytes_per_s": piece_bytes / seconds,
            "contiguous_bytes_per_s": device.numel() * 2 / whole,
        }
    return result


def model_spec(name: str) -> ModelSpec:
    raw = SHAPES[name]
    config = ModelConfig.from_hf_config(raw)
    return ModelSpec(
        name=name, num_layers=config.num_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size, tie_word_embeddings=config.tie_word_embeddings,
    )  # fmt: skip


def implied_constants(rows: dict[str, Any], preset: CostModel) -> dict[str, float]:
    """First-order readings of the preset's constants from the measurements, beside the
    preset's own: a batch-1 decode is the weight read plus the step overhead (its bandwidth
    share is a lower bound: the overhead is in the step), the largest prefill is linear-layer
    FLOPs, a contiguous copy is the link, and a layer piece is latency plus its bytes."""
    model, gpu, config = preset.model, preset.gpu, preset.config
    one_s = rows["decode"]["1"]["step_s"]
    read_s = model.weight_bytes / (gpu.hbm_bytes_per_s * config.bandwidth_efficiency)
    num_tokens = max(int(t) for t in rows["prefill"])
    prefill = rows["prefill"][str(num_tokens)]
    flops = 2.0 * model.num_params * num_tokens
    h2d = rows["copy_pieces"]["h2d"]
    link = h2d["contiguous_bytes_per_s"]
    piece_s = h2d["per_piece_s"] - rows["copy_pieces"]["piece_bytes"] / link
    return {
        "step_overhead_s": max(one_s - read_s, 0.0),
        "preset_step_overhead_s": config.step_overhead_s,
        "bandwidth_efficiency_at_least": model.weight_bytes / (gpu.hbm_bytes_per_s * one_s),
        "preset_bandwidth_efficiency": config.bandwidth_efficiency,
        "compute_efficiency": flops / prefill["step_s"] / gpu.bf16_flops_per_s,
        "preset_compute_efficiency": config.compute_efficiency,
        "pcie_bytes_per_s": link,
        "preset_pcie_bytes_per_s": preset.pcie_bytes_per_s,
        "copy_latency_s": max(piece_s, 0.0),
        "preset_copy_latency_s": preset.copy_latency_s,
    }


def write_model_dir(directory: Path, tokenizer_dir: Path) -> None:
    """A SmolLM2-135M-shaped checkpoint with random bfloat16 weights and the real tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in SHAPES["smollm2-135m"].items() if k != "model_type"})
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--tokenizer-dir", type=Path, default=None)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated")
    parser.add_argument("--smoke", action="store_true", help="tiny points on this CPU")
    args = parser.parse_args(argv)
    sizes = SMOKE if args.smoke else Sizes()
    if sizes.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check.measure: error: no CUDA device (--smoke runs tiny points on a CPU)",
            file=sys.stderr,
        )
        return 2
    gpu = get_gpu("H200")
    name_of_device = torch.cuda.get_device_name() if sizes.device == "cuda" else "cpu (smoke)"
    figures: dict[str, Any] = {"device": name_of_device, "preset": gpu.name}
    for name in args.shapes.split(","):
        preset = CostModel(gpu, model_spec(name))
        rows = throughput(name, preset, sizes)
        rows["copy_pieces"] = copy_pieces(SHAPES[name], sizes)
        rows["implied"] = implied_constants(rows, preset)
        figures[name] = rows
        args.out.write_text(json.dumps(figures, indent=2) + "\n")  # what is done so far
    if args.model_dir is not None and args.tokenizer_dir is not None:
        write_model_dir(args.model_dir, args.tokenizer_dir)
        figures["model_dir"] = str(args.model_dir)
    args.out.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
