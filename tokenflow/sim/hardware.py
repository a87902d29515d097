"""GPU and model specifications for the simulator, from public datasheets and config.json files.

Units are SI: FLOP/s, bytes/s, bytes.  GPU memory sizes on datasheets ("80GB", "24GB") are binary
in practice (nvidia-smi reports 81559 MiB for an 80GB H100, 24564 MiB for an RTX 4090), so they are
stored as GiB.  Bandwidths and FLOP/s are decimal (1 TB/s = 1e12 bytes/s).
"""

from __future__ import annotations

from dataclasses import dataclass

_GIB = 2**30


@dataclass(frozen=True)
class GpuSpec:
    """Peak figures of one GPU: dense bf16 tensor FLOP/s (no sparsity) and memory bandwidths."""

    name: str
    bf16_flops_per_s: float
    hbm_bytes_per_s: float  # device memory bandwidth (HBM or GDDR)
    memory_bytes: int
    pcie_bytes_per_s: float  # effective pinned-memory host <-> device bandwidth, per direction
    pcie_peak_bytes_per_s: float = 0.0  # the link's nominal rate (documentation; 0: unknown)
    # Fixed cost of one host <-> device copy operation (a cudaMemcpyAsync: launch + DMA setup).
    copy_latency_s: float = 5e-6

    def __post_init__(self) -> None:
        for field_name in ("bf16_flops_per_s", "hbm_bytes_per_s", "memory_bytes"):
            if getattr(self, field_name) <= 0:
                raise ValueError(f"GPU {self.name}: {field_name} must be > 0")
        if self.pcie_bytes_per_s <= 0:
            raise ValueError(f"GPU {self.name}: pcie_bytes_per_s must be > 0")
        if self.pcie_peak_bytes_per_s and self.pcie_bytes_per_s > self.pcie_peak_bytes_per_s:
            raise ValueError(f"GPU {self.name}: effective PCIe bandwidth exceeds the peak")
        if not self.copy_latency_s >= 0:
            raise ValueError(f"GPU {self.name}: copy_latency_s must be >= 0")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer with grouped-query attention and a gated (SwiGLU) MLP.

    Parameter counts ignore biases (Qwen2 has q/k/v biases: ~0.1M parameters, < 0.01%).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for field_name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "dtype_bytes",
        ):
            if getattr(self, field_name) < 1:
                raise ValueError(f"model {self.name}: {field_name} must be >= 1")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"model {self.name}: num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def num_params_per_layer(self) -> int:
        """q, k, v, o projections, gate/up/down MLP projections and two RMSNorm weights."""
        q_dim = self.num_attention_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q_dim + 2 * kv_dim) + q_dim * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return attention + mlp + 2 * self.hidden_size

    @property
    def num_layer_params(self) -> int:
        """Non-embedding parameters: all transformer layers plus the final norm."""
        return self.num_layers * self.num_params_per_layer + self.hidden_size

    @property
    def num_lm_head_params(self) -> int:
        """The output projection (the embedding matrix itself when tied)."""
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        embeddings = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else self.num_lm_head_params
        return self.num_layer_params + embeddings + lm_head

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


def gpu_specs() -> dict[str, GpuSpec]:
    """Known GPUs by canonical name (a fresh dict on each call)."""
    # PCIe, per direction: Gen5 x16 is 64 GB/s nominal (63 GB/s after 128b/130b encoding;
    # NVIDIA lists 128 GB/s bidirectional), Gen4 x16 32 GB/s (31.5).  Published pinned-memory
    # measurements (CUDA's bandwidthTest and nvbandwidth on H100/H200 hosts, vendor and forum
    # reports for RTX 4090/A100 workstations) reach ~50-55 GB/s and ~24-26 GB/s: about 80% of
    # nominal, lost to TLP headers and flow control.  We take 50 and 25 GB/s.
    # Per copy: cudaMemcpyAsync costs a few microseconds of launch and DMA setup however small
    # the copy (microbenchmarks report ~2-5 us to issue, ~5-10 us end to end for a small
    # pinned transfer); copies queued back to back pipeline, so 5 us per operation is charged.
    gen5 = {"pcie_bytes_per_s": 50e9, "pcie_peak_bytes_per_s": 64e9, "copy_latency_s": 5e-6}
    gen4 = {"pcie_bytes_per_s": 25e9, "pcie_peak_bytes_per_s": 32e9, "copy_latency_s": 5e-6}
    return {
        # H200 SXM: 1,979 TFLOPS bf16 with sparsity -> 989.5 dense; HBM3e 4.8 TB/s; 141 GB.
        "H200": GpuSpec("H200", 989.5e12, 4.8e12, 141 * _GIB, **gen5),
        # H100 SXM: 1,979 TFLOPS bf16 with sparsity -> 989.5 dense; HBM3 3.35 TB/s; 80 GB.
        "H100": GpuSpec("H100 SXM", 989.5e12, 3.35e12, 80 * _GIB, **gen5),
        # A100 80GB SXM: 312 TFLOPS bf16 dense; HBM2e 2,039 GB/s; 80 GB.
        "A100": GpuSpec("A100 80GB SXM", 312e12, 2.039e12, 80 * _GIB, **gen4),
        # RTX A6000: 154.8 TFLOPS bf16 dense (309.7 with sparsity); GDDR6 768 GB/s; 48 GB.
        "A6000": GpuSpec("RTX A6000", 154.8e12, 768e9, 48 * _GIB, **gen4),
        # RTX 4090 (Ada whitepaper): 165.2 TFLOPS bf16 with fp32 accumulate, dense;
        # GDDR6X 1,008 GB/s; 24 GB.
        "RTX4090": GpuSpec("RTX 4090", 165.2e12, 1008e9, 24 * _GIB, **gen4),
    }


def model_specs() -> dict[str, ModelSpec]:
    """Known models by canonical name (a fresh dict on each call), from their config.json."""
    return {
        # meta-llama/Meta-Llama-3-8B
        "Llama3-8B": ModelSpec(
            name="Llama3-8B",
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=14336,
            vocab_size=128256,
            tie_word_embeddings=False,
        ),
        # Qwen/Qwen2-7B
        "Qwen2-7B": ModelSpec(
            name="Qwen2-7B",
            num_layers=28,
            hidden_size=3584,
            num_attention_heads=28,
            num_kv_heads=4,
            head_dim=128,
            intermediate_size=18944,
            vocab_size=152064,
            tie_word_embeddings=False,
        ),
        # Qwen/Qwen2.5-32B
        "Qwen2.5-32B": ModelSpec(
            name="Qwen2.5-32B",
            num_layers=64,
            hidden_size=5120,
            num_attention_heads=40,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=27648,
            vocab_size=152064,
            tie_word_embeddings=False,
        ),
    }


def _normalize(name: str) -> str:
    """'RTX 4090' -> 'rtx4090', 'Qwen/Qwen2.5-32B-Instruct' -> 'qwen2532b'."""
    key = name.rsplit("/", 1)[-1].lower()
    key = "".join(ch for ch in key if ch.isalnum())
    return key.removesuffix("instruct")


def _gpu_aliases() -> dict[str, str]:
    aliases = {_normalize(name): name for name in gpu_specs()}
    aliases.update(
        {
            "h200sxm": "H200",
            "h100sxm": "H100",
            "a10080gb": "A100",
            "a10080gbsxm": "A100",
            "a100sxm": "A100",
            "rtxa6000": "A6000",
            "4090": "RTX4090",
            "geforcertx4090": "RTX4090",
        }
    )
    return aliases


def _model_aliases() -> dict[str, str]:
    aliases = {_normalize(name): name for name in model_specs()}
    aliases.update({"llama8b": "Llama3-8B", "metallama38b": "Llama3-8B", "llama318b": "Llama3-8B"})
    return aliases


def get_gpu(name: str) -> GpuSpec:
    """Look a GPU up by name, ignoring case, spaces and dashes ('h200', '4090', 'RTX 4090')."""
    specs = gpu_specs()
    canonical = _gpu_aliases().get(_normalize(name))
    if canonical is None:
        raise ValueError(f"unknown GPU {name!r}; valid names: {', '.join(specs)}")
    return specs[canonical]


def get_model(name: str) -> ModelSpec:
    """Look a model up by name, ignoring case and punctuation ('llama3-8b', 'Qwen/Qwen2-7B')."""
    specs = model_specs()
    canonical = _model_aliases().get(_normalize(name))
    if canonical is None:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(specs)}")
    return specs[canonical]
