"""Kernel choices on disk, keyed by what makes one machine's timings differ from another's."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenflow.model.kernels.plan import KernelChoice, KernelPlan, RegimeCost

logger = logging.getLogger(__name__)

CACHE_VERSION = 1


def machine_key(threads: int, serial_below_tokens: int) -> dict[str, object]:
    """What makes one machine's timings differ from another's: the CPU (model and flags), the
    kernels torch dispatches to (its version, capability and the ISA limits set in the
    environment) and the threads a step runs on."""
    model_name, flags = _cpuinfo()
    return {
        "cpu": model_name,
        "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY", ""),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        "mkl_enable_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS", ""),
        "threads": threads,
        "serial_below_tokens": serial_below_tokens,
    }


def model_file_key(path: Path) -> dict[str, object]:
    """The model file as a cached measurement depends on it: resolved path, size and
    modification time (a changed file is measured again)."""
    resolved = path.resolve()
    stat = resolved.stat()
    return {"model": str(resolved), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def model_key(path: Path, dtypes: Sequence[str], has_int4: bool) -> dict[str, object]:
    """The model file (`model_file_key`) and the paths it allows."""
    return {**model_file_key(path), "dtypes": list(dtypes), "int4": has_int4}


def _cpuinfo() -> tuple[str, str]:
    """(model name, flags) from /proc/cpuinfo; the platform's names where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return platform.processor() or platform.machine(), ""
    fields_of: dict[str, str] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        fields_of.setdefault(name.strip(), value.strip())
    return fields_of.get("model name", platform.machine()), fields_of.get("flags", "")


def default_cache_dir() -> Path:
    """$TOKENFLOW_CACHE_DIR, else $XDG_CACHE_HOME/tokenflow, else ~/.cache/tokenflow."""
    if os.environ.get("TOKENFLOW_CACHE_DIR"):
        return Path(os.environ["TOKENFLOW_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenflow"


@dataclass
class KernelCache:
    """Kernel choices on disk, one JSON file per key (machine + model), under `directory`."""

    directory: Path = field(default_factory=lambda: default_cache_dir() / "kernels")

    def path_for(self, key: dict[str, object]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return self.directory / f"{digest}.json"

    def load(self, key: dict[str, object]) -> KernelChoice | None:
        """The choice stored for exactly `key`, or None (absent, another key, unreadable)."""
        path = self.path_for(key)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("version") != CACHE_VERSION or data.get("key") != key:
                return None
            choice = data["choice"]
            return KernelChoice(
                KernelPlan(**choice["plan"]),
                "cache",
                tuple(RegimeCost(**c) for c in choice["costs"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def store(self, key: dict[str, object], choice: KernelChoice) -> bool:
        """Write the choice (atomically); whether it was written (a cache that cannot be
        written is only logged)."""
        record = {"version": CACHE_VERSION, "key": key, "choice": choice.to_json()}
        return write_record(self.path_for(key), record)


def write_record(path: Path, record: dict[str, object]) -> bool:
    """Write a cache record as JSON, atomically; whether it was written (a cache that cannot
    be written is only logged)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps(record, indent=1), encoding="utf-8")
        partial.replace(path)
    except OSError as exc:
        logger.warning("cannot write the cache %s: %s", path, exc)
        return False
    return True
