"""Shared helpers for the engine tests: tiny HF checkpoints and hand-built step plans."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from tokenflow.core.plan import BlockCopy, ScheduledChunk, StepPlan
from tokenflow.core.request import SamplingParams
from tokenflow.engine import ModelExecutor
from tokenflow.model import LlamaModel, TieredKVCache, build_model_inputs

# Devices a test runs on: the CPU always, CUDA as a `gpu` test where a CUDA device exists.
CUDA = pytest.param(
    "cuda",
    marks=(
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
)
DEVICES = ("cpu", CUDA)

GREEDY = SamplingParams(max_tokens=64, temperature=0.0)
# Greedy with EOS masked, as transformers' `min_new_tokens` does in `hf_greedy`.
GREEDY_NO_EOS = SamplingParams(max_tokens=64, temperature=0.0, min_tokens=64)

# bfloat16 keeps 8 significant bits: rounding to nearest moves a value by at most 2^-8 of it.
BF16_UNIT_ROUNDOFF = 2.0**-8
# An upper count of the roundings to bfloat16 on one int4 projection's path: the group's scale
# and zero, the dequantized weight (where a kernel forms it in bf16) and the output.
BF16_ROUNDINGS_PER_INT4_PROJECTION = 4
# Per decoder layer: input norm 2 (to bf16, times its weight), QKV 4, RoPE 4 (cos, sin, x * cos,
# the fused add), attention 3 (scores, probabilities, output), output projection 4 + 1 residual
# add, post-attention norm 2, gate/up 4, SiLU and the product 2, down 4 + 1 residual add.  A dense
# bf16 projection rounds twice (weight, output) and a fused kernel rounds less: an upper count.
BF16_ROUNDINGS_PER_LAYER = 31
# Outside the layers: the embedding row, the final norm (2), the LM head's weight and output.
BF16_ROUNDINGS_OUTSIDE_LAYERS = 5


def bf16_error_bound(magnitude: float, num_roundings: int) -> float:
    """How far `num_roundings` bfloat16 roundings in series move a result of size `magnitude`.

    Each rounding is an unbiased relative error of at most 2^-8; independent errors add in
    quadrature (Wilkinson's rule for accumulated rounding), giving sqrt(N) * 2^-8 of the
    magnitude.  CPUs differ (AVX2, AVX-512 bf16, AMX) in which of the counted roundings their
    kernels make, not in the size of one, so a bound from the count holds on each of them.
    """
    return math.sqrt(num_roundings) * BF16_UNIT_ROUNDOFF * magnitude


def bf16_logit_bound(logits: torch.Tensor, num_layers: int) -> float:
    """`bf16_error_bound` for a bfloat16 model's logits, scaled by their largest magnitude."""
    num_roundings = num_layers * BF16_ROUNDINGS_PER_LAYER + BF16_ROUNDINGS_OUTSIDE_LAYERS
    return bf16_error_bound(float(logits.abs().max()), num_roundings)


TINY_LLAMA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def make_hf_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random transformers model: "llama", "llama3" (rope scaling) or "qwen2"."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY_LLAMA, tie_word_embeddings=True))
    else:
        extra = {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0} if kind == "llama3" else {}
        model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, **extra))
    with torch.no_grad():  # random biases, so a wrongly loaded bias shows
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    return model.eval()


def save_hf_model(model: torch.nn.Module, directory: Path, **kwargs: object) -> Path:
    model.save_pretrained(directory, **kwargs)
    return directory


def chunk(
    request_id: str,
    token_ids: Sequence[int],
    start: int,
    blocks: Sequence[int],
    num_output_tokens: int = 0,
    samples_token: bool = True,
    params: SamplingParams = GREEDY,
) -> ScheduledChunk:
    return ScheduledChunk(  # the whole table every time: a delta from index 0
        request_id=request_id,
        token_ids=tuple(token_ids),
        start_position=start,
        new_block_ids=tuple(blocks),
        block_table_start=0,
        samples_token=samples_token,
        sampling_params=params,
        num_output_tokens=num_output_tokens,
    )


def plan(
    chunks: Sequence[ScheduledChunk],
    device_to_host: Sequence[BlockCopy] = (),
    host_to_device: Sequence[BlockCopy] = (),
    released: Sequence[str] = (),
    step: int = 0,
) -> StepPlan:
    return StepPlan(
        step, tuple(chunks), tuple(device_to_host), tuple(host_to_device), tuple(released)
    )


def our_logits(
    model: LlamaModel, kv_cache: TieredKVCache, chunks: Sequence[ScheduledChunk]
) -> torch.Tensor:
    """Run one step's forward directly: logits [num_sampled, vocab] in plan order."""
    with torch.inference_mode():
        tables = {c.request_id: c.new_block_ids for c in chunks}
        inputs = build_model_inputs(chunks, tables, kv_cache.block_size, kv_cache.device)
        return model(inputs.input_ids, inputs.positions, inputs.attn, kv_cache.device_layers)


def hf_next_logits(hf_model: torch.nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """transformers' logits [vocab] for the token after `token_ids` (no cache)."""
    with torch.inference_mode():
        input_ids = torch.tensor([list(token_ids)], device=hf_model.device)
        return hf_model(input_ids).logits[0, -1].float()


def greedy_generate(
    executor: ModelExecutor,
    prompts: Sequence[Sequence[int]],
    tables: Sequence[Sequence[int]],
    num_new: int,
    prefill_chunk: int | None = None,
    params: SamplingParams = GREEDY_NO_EOS,
) -> list[list[int]]:
    """Greedy tokens per prompt, batched; prompts prefilled in chunks of `prefill_chunk`."""
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [0] * len(prompts)  # prompt tokens whose KV is computed
    while any(len(out) < num_new for out in outputs):
        chunks = []
        for i, prompt in enumerate(prompts):
            if len(outputs[i]) >= num_new:
                continue
            if done[i] < len(prompt):
                size = prefill_chunk or len(prompt)
                tokens = prompt[done[i] : done[i] + size]
                last = done[i] + len(tokens) == len(prompt)
                chunks.append(chunk(f"r{i}", tokens, done[i], tables[i], 0, last, params))
                done[i] += len(tokens)
            else:
                position = len(prompt) + len(outputs[i]) - 1
                num_out = len(outputs[i])
                chunks.append(
                    chunk(f"r{i}", [outputs[i][-1]], position, tables[i], num_out, True, params)
                )
        for sampled in executor.execute(plan(chunks)).sampled:
            outputs[int(sampled.request_id[1:])].append(sampled.token_id)
    return outputs


def hf_greedy(hf_model: torch.nn.Module, prompt: Sequence[int], num_new: int) -> list[int]:
    """transformers `generate(do_sample=False)` with exactly `num_new` new tokens."""
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([list(prompt)], device=hf_model.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=hf_model.device),
            do_sample=False,
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Q/K rows (interleave each head's two halves)."""
    half = weight.shape[0] // num_heads // 2
    rows = weight.reshape(num_heads, 2, half, *weight.shape[1:])
    return rows.transpose(1, 2).reshape(weight.shape)


def write_tiny_gguf(hf_model: torch.nn.Module, path: Path) -> Path:
    """Write a transformers Llama/Qwen2 model as an F32 GGUF, the way llama.cpp converts it."""
    import gguf

    config = hf_model.config
    arch = config.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    _add_tiny_tokenizer(writer, config.vocab_size)
    for name, tensor in _gguf_tensors(hf_model).items():
        writer.add_tensor(name, tensor.detach().float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tiny_tokenizer(writer: object, vocab_size: int) -> None:
    # Single byte-level characters for "a".."z" etc., an "ab" merge, and an EOS control token.
    chars = [chr(c) for c in range(33, 33 + vocab_size - 2)]
    tokens = [*chars, "ab", "<eos>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab_size - 1) + [3])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(vocab_size - 1)
    writer.add_bos_token_id(vocab_size - 1)


def _gguf_tensors(hf_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    config = hf_model.config
    state = hf_model.state_dict()
    permute = config.model_type == "llama"
    out = {"token_embd.weight": state["model.embed_tokens.weight"]}
    out["output_norm.weight"] = state["model.norm.weight"]
    if not config.tie_word_embeddings:
        out["output.weight"] = state["lm_head.weight"]
    names = {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for layer in range(config.num_hidden_layers):
        for gguf_name, hf_name in names.items():
            for suffix in ("weight", "bias"):
                tensor = state.get(f"model.layers.{layer}.{hf_name}.{suffix}")
                if tensor is None:
                    continue
                if permute and gguf_name in heads:
                    tensor = _llama_cpp_permute(tensor, heads[gguf_name])
                out[f"blk.{layer}.{gguf_name}.{suffix}"] = tensor
    return out


# A prompt whose greedy continuation (" f, g, h, i, j, k,") never hangs on a near tie: in each of
# its 12 steps the dense model's top logit leads the next by 2.7 or more, over 4x the largest
# bf16 logit error measured (0.40 with AVX-512 bf16, 0.64 on an AMX machine).
DECISIVE_PROMPT = "The alphabet: a, b, c, d, e,"


def loaded_prefill_logits(loaded, prompt: list[int]) -> torch.Tensor:
    """A loaded model's next-token logits after `prompt` (one prefill, 8 blocks of 16)."""
    from tokenflow.model import TieredKVCache

    kv = TieredKVCache(loaded.config, 8, 1, 16, "cpu", loaded.model.dtype)
    return our_logits(loaded.model, kv, [chunk("r0", prompt, 0, list(range(8)), 0, True)])[0]


def loaded_greedy(loaded, prompt: list[int], num_new: int) -> list[int]:
    """A loaded model's `num_new` greedy tokens after `prompt`, through the executor."""
    from tokenflow.engine import ModelExecutor
    from tokenflow.model import TieredKVCache

    kv = TieredKVCache(loaded.config, 8, 1, 16, "cpu", loaded.model.dtype)
    executor = ModelExecutor(loaded.model, loaded.config, kv, "cpu")
    return greedy_generate(executor, [prompt], [list(range(8))], num_new=num_new)[0]
