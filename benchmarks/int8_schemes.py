"""int8-compute weight schemes on fbgemm's dynamic int8 GEMM, for the benchmarks only.

Not a weight format of the engine: none of these met the accuracy bar (the default int4 path's
greedy agreement with, and logit drift from, the float32 model) while being faster than the
default path; see benchmarks/quant_accuracy.py, benchmarks/quant_kernels.py and
benchmarks/decode_step.py --int8.  Measured here (10 prompts x 48 greedy tokens, one stream +
one batch, next-token max |logit diff| max/median): int4 539/960, 0.57/0.37; "tensor" 51, 14/7.8;
"token" 137, 3.6/2.7; "token-o64" 300, 1.1/0.97 and 0.73-0.82x the default's decode steps;
"head-token" 517, 1.14/0.81 and 1.1-1.3x.  The schemes:

- "tensor": fbgemm as it is: int8 weights (one scale per output row), the activations
  quantized with one scale for the whole call (all rows),
- "token": the same kernel with per-token activation scales: each row is divided by its max |x|
  before fbgemm's per-tensor quantization and the row's output multiplied back (the GEMM is
  linear in x),
- "token-oK": per-token, plus the K input channels with the largest maxima on a calibration
  text kept out of the int8 GEMM and run as a small float32 GEMM (LLM.int8()-style),
- "head-...": only the LM head (the largest single GEMM, dense bfloat16 today because the tied
  embedding is Q8_0) through the scheme; the layers keep the default int4 path.

Why the activations are the problem: a few channels of the layers' inputs are tens of times
larger than the rest (up to ~30x the row RMS in SmolLM2-135M), so one int8 scale per row leaves
one or two levels for most channels.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from tokenflow.core.plan import ScheduledChunk, StepPlan
from tokenflow.core.request import SamplingParams
from tokenflow.engine import ModelExecutor, TieredKVCache
from tokenflow.engine.model import LlamaModel, LMHead, Projection

# Calibration text for the per-channel activation maxima: mixed prose, code, numbers, chat.
CALIBRATION_TEXT = (
    "In 1905, Albert Einstein published four papers that changed physics: on the photoelectric "
    "effect, Brownian motion, special relativity and the equivalence of mass and energy.\n"
    "import numpy as np\nfor i in range(10):\n    print(i * i)\n"
    "The recipe calls for two cups of flour, a pinch of salt, and three eggs. Q: What is 17 "
    "times 23? A: 391. Dear team, the meeting is moved to Thursday at 3 pm.\n"
    "<|im_start|>user\nTranslate 'good morning' to Spanish.<|im_end|>\n"
    "<|im_start|>assistant\nBuenos días.<|im_end|>"
)
SCHEMES = (
    "tensor",
    "token",
    "token-o16",
    "token-o64",
    "head-token",
    "head-token-o8",
    "head-token-o32",
)
GREEDY = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)


def _use_fbgemm() -> None:
    if "x86" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "x86"


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: weight [out, in] -> codes int8 [out, in], scales [out]."""
    scales = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12)
    codes = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


class PackedInt8:
    """A float weight [out, in] as int8 columns for fbgemm plus float `outliers` columns.

    `matmul(x)` is x @ weight.T for x [T, in], computed in float32 and returned in x's dtype.
    """

    def __init__(self, weight: torch.Tensor, outliers: torch.Tensor, per_token: bool) -> None:
        _use_fbgemm()
        weight = weight.float()
        self.per_token = per_token
        self.outliers = outliers.long()
        self.outlier_weight_t = weight[:, self.outliers].t().contiguous()  # [k, out]
        codes, scales = quantize_rows(weight.index_fill(1, self.outliers, 0.0))
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        qweight = torch._make_per_channel_quantized_tensor(codes, scales.double(), zero_points, 0)
        self.packed = torch.ops.quantized.linear_prepack(qweight, None)

    def dequantized(self) -> torch.Tensor:
        """The float32 [out, in] weight this stands for (int8 columns rounded, outliers exact)."""
        qweight, _ = torch.ops.quantized.linear_unpack(self.packed)
        weight = qweight.dequantize()
        weight[:, self.outliers] = self.outlier_weight_t.t()
        return weight

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        xf = x.float()
        has_outliers = self.outliers.numel() > 0
        rest = xf.index_fill(1, self.outliers, 0.0) if has_outliers else xf.contiguous()
        if self.per_token and rest.shape[0] > 1:  # one row: per-tensor is already per-token
            row_max = rest.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12)  # [T, 1]
            rest = rest / row_max
            out = torch.ops.quantized.linear_dynamic(rest, self.packed, False).mul_(row_max)
        else:
            out = torch.ops.quantized.linear_dynamic(rest, self.packed, False)
        if has_outliers:
            out.addmm_(xf.index_select(1, self.outliers), self.outlier_weight_t)
        return out if x.dtype == torch.float32 else out.to(x.dtype)


class Int8Projection(nn.Module):
    """A `Projection` (same call: x, optional residual) whose GEMM is a PackedInt8."""

    def __init__(self, proj: Projection, packed: PackedInt8) -> None:
        super().__init__()
        self.packed = packed
        self.bias = proj.bias

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] -> [T, out] (+ bias, + residual)."""
        out = self.packed.matmul(x)
        if self.bias is not None:
            out = out.add_(self.bias)
        return out if residual is None else out.add_(residual)


class Int8Head(nn.Module):
    """The LM head through a PackedInt8 copy; `weight` stays for the tied embedding."""

    def __init__(self, head: LMHead, packed: PackedInt8) -> None:
        super().__init__()
        self.weight = head.weight
        self.packed = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> logits [T, vocab]."""
        return self.packed.matmul(x)


def run_prefill(model: LlamaModel, config, token_ids: Sequence[int]) -> None:
    """One prefill step of `token_ids` through `model` (a scratch KV cache)."""
    num_blocks = -(-(len(token_ids) + 1) // 16)
    kv = TieredKVCache(config, num_blocks, 1, 16, "cpu", model.dtype)
    chunk = ScheduledChunk("c", tuple(token_ids), 0, tuple(range(num_blocks)), 0, True, GREEDY, 0)
    ModelExecutor(model, config, kv, "cpu").execute(StepPlan(0, (chunk,), (), (), ()))


def record_input_maxima(
    modules: Sequence[nn.Module], run: Callable[[], None]
) -> list[torch.Tensor]:
    """Per-input-channel max |x| [in] of every module's first input while `run()` executes."""
    maxima: dict[int, torch.Tensor] = {}

    def hook_for(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            seen = args[0].detach().float().abs().amax(dim=0)
            maxima[index] = torch.maximum(maxima.get(index, seen), seen)

        return hook

    handles = [m.register_forward_pre_hook(hook_for(i)) for i, m in enumerate(modules)]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return [maxima[i] for i in range(len(modules))]


def convert(model: LlamaModel, config, scheme: str, calibration_ids: Sequence[int]) -> None:
    """Replace the projections and the LM head of `model` (only the head: "head-...") by int8
    `scheme`; the layers of a float32 model, the head of any."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}")
    num_outliers = int(scheme.split("-o")[1]) if "-o" in scheme else 0
    targets = []
    if not scheme.startswith("head-"):
        targets += [(layer.self_attn, "qkv_proj") for layer in model.layers]
        targets += [(layer.self_attn, "o_proj") for layer in model.layers]
        targets += [(layer.mlp, "gate_up_proj") for layer in model.layers]
        targets += [(layer.mlp, "down_proj") for layer in model.layers]
    targets.append((model, "lm_head"))
    modules = [getattr(owner, name) for owner, name in targets]
    maxima = record_input_maxima(modules, lambda: run_prefill(model, config, calibration_ids))
    for (owner, name), module, input_max in zip(targets, modules, maxima, strict=True):
        outliers = input_max.topk(num_outliers).indices.sort().values
        packed = PackedInt8(module.weight, outliers, per_token=scheme != "tensor")
        wrapper = Int8Head if name == "lm_head" else Int8Projection
        setattr(owner, name, wrapper(module, packed))
