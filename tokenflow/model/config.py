"""The shape of a Llama-family model, parsed from an HF `config.json` or from GGUF metadata."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


class ModelLoadError(Exception):
    """A model could not be loaded: missing or corrupt file, missing tensor, unsupported model."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency-dependent RoPE scaling (`rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs to know about a model's shape and numerics."""

    architecture: str  # "llama" | "qwen2"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the Q, K and V projections (always on for qwen2)
    attention_output_bias: bool = False  # bias on the output projection (llama attention_bias)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(_unsupported(self.architecture))
        positive = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim")
        for name in (*positive, "intermediate_size", "vocab_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ModelLoadError(f"model config: {name} must be an integer >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"model config: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelLoadError(
                f"model config: head_dim must be even for RoPE, got {self.head_dim}"
            )

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id, or None when the model declares none."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def kv_elements_per_token(self) -> int:
        """Elements of K and V that one token stores over all layers (times the dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Parse a transformers `config.json` dict (v4 `rope_scaling` or v5 `rope_parameters`)."""
        architecture = str(raw.get("model_type", "<missing model_type>"))
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(_unsupported(architecture))
        _reject_unsupported_hf_features(raw)
        num_heads = _required(raw, "num_attention_heads")
        hidden_size = _required(raw, "hidden_size")
        rope = dict(raw.get("rope_parameters") or {})
        rope_theta = float(raw.get("rope_theta", rope.get("rope_theta", 10000.0)))
        scaling = raw.get("rope_scaling") or rope
        is_llama = architecture == "llama"
        return cls(
            architecture=architecture,
            num_layers=_required(raw, "num_hidden_layers"),
            hidden_size=hidden_size,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            intermediate_size=_required(raw, "intermediate_size"),
            vocab_size=_required(raw, "vocab_size"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=_parse_rope_scaling(scaling),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)) if is_llama else True,
            attention_output_bias=bool(raw.get("attention_bias", False)) if is_llama else False,
            bos_token_id=_optional_int(raw.get("bos_token_id")),
            eos_token_ids=_int_tuple(raw.get("eos_token_id")),
        )

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], tensor_names: Collection[str]
    ) -> ModelConfig:
        """Parse GGUF key/values (`llama.block_count`, ...); tensor names decide tied embeddings."""
        architecture = str(metadata.get("general.architecture", "<missing general.architecture>"))
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(_unsupported(architecture))
        if "rope_freqs.weight" in tensor_names or f"{architecture}.rope.scaling.type" in metadata:
            raise ModelLoadError(
                "GGUF RoPE scaling (rope_freqs tensor or rope.scaling.* keys) is not supported; "
                "load the HF safetensors checkpoint instead"
            )

        def key(name: str, default: Any = None) -> Any:
            value = metadata.get(f"{architecture}.{name}", default)
            if value is None:
                raise ModelLoadError(f"GGUF metadata lacks {architecture}.{name}")
            return value

        hidden_size = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        tokens = metadata.get("tokenizer.ggml.tokens")
        vocab_size = metadata.get(f"{architecture}.vocab_size") or (len(tokens) if tokens else None)
        if vocab_size is None:
            raise ModelLoadError("GGUF metadata has neither a vocab_size nor tokenizer tokens")
        return cls(
            architecture=architecture,
            num_layers=int(key("block_count")),
            hidden_size=hidden_size,
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=int(key("attention.key_length", hidden_size // num_heads)),
            intermediate_size=int(key("feed_forward_length")),
            vocab_size=int(vocab_size),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=None,
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias=architecture == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
            attention_output_bias="blk.0.attn_output.bias" in tensor_names,
            bos_token_id=_optional_int(metadata.get("tokenizer.ggml.bos_token_id")),
            eos_token_ids=_int_tuple(metadata.get("tokenizer.ggml.eos_token_id")),
        )


def _unsupported(architecture: str) -> str:
    return (
        f"unsupported model architecture {architecture!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _reject_unsupported_hf_features(raw: Mapping[str, Any]) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is supported")
    if raw.get("mlp_bias"):
        raise ModelLoadError("unsupported config: mlp_bias=true")
    if raw.get("use_sliding_window"):
        raise ModelLoadError("unsupported config: use_sliding_window=true (sliding attention)")


def _parse_rope_scaling(raw: Mapping[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    rope_type = raw.get("rope_type", raw.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ModelLoadError(f"unsupported rope_type {rope_type!r}; supported: default, llama3")
    try:
        return RopeScaling(
            factor=float(raw["factor"]),
            low_freq_factor=float(raw["low_freq_factor"]),
            high_freq_factor=float(raw["high_freq_factor"]),
            original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise ModelLoadError(f"llama3 rope scaling lacks {exc.args[0]!r}") from None


def _required(raw: Mapping[str, Any], name: str) -> int:
    if name not in raw:
        raise ModelLoadError(f"model config lacks {name!r}")
    return int(raw[name])


def _optional_int(value: Any) -> int | None:
    if isinstance(value, list | tuple):
        value = value[0] if value else None
    return None if value is None else int(value)


def _int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return (int(value),)
