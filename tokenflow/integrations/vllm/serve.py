"""Launch vLLM's OpenAI server with TokenFlow's scheduler and `stream_rate` support.

    python -m tokenflow.integrations.vllm.serve --model DIR [--default-rate R] [--no-host-kv]
        [vLLM flags...]

is the same as

    python -m vllm.entrypoints.openai.api_server --model DIR [vLLM flags...] \\
        --scheduler-cls tokenflow.integrations.vllm.TokenFlowScheduler \\
        --middleware tokenflow.integrations.vllm.middleware.StreamRateMiddleware \\
        --kv-transfer-config CONNECTOR [--additional-config '{"tokenflow": {"default_rate": R}}']

with the connector that keeps paused streams' KV in host memory on this platform:

- CUDA-alike and XPU GPUs: vLLM's own `OffloadingConnector` (write-through to an LRU host
  pool), `{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
  "kv_connector_extra_config": {"offload_prompt_only": false}}`, sized by vLLM's
  `--kv-offloading-size` GiB (default 16), with `--enable-prefix-caching`;
- elsewhere (vLLM's CPU platform, where vLLM's connectors do not run): our `HostKVConnector`,
  `{"kv_connector": "HostKVConnector", "kv_role": "kv_both",
  "kv_connector_module_path": "tokenflow.integrations.vllm.host_kv"}`.

No connector is added with `--no-host-kv`, or when the vLLM flags choose one
(`--kv-transfer-config`, `--kv-offloading-backend`; `--kv-offloading-size` on a CPU); pauses
are then recomputes unless that connector is one of the two above.

Run it with a Python that has vLLM installed (`pip install tokenflow[vllm]`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

SCHEDULER_CLS = "tokenflow.integrations.vllm.TokenFlowScheduler"
MIDDLEWARE = "tokenflow.integrations.vllm.middleware.StreamRateMiddleware"
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
SERVE_MODULE = "tokenflow.integrations.vllm.serve"
# vLLM flags that choose a KV connector: the user's choice then replaces ours.
CONNECTOR_FLAGS = ("--kv-transfer-config", "--kv-offloading-backend")
OFFLOADING_SIZE_FLAG = "--kv-offloading-size"  # GiB of vLLM's host pool (all TP ranks together)
DEFAULT_OFFLOADING_GIB = 16.0  # best set to about host_factor (3) x the device KV pool
PREFIX_CACHING_FLAGS = ("--enable-prefix-caching", "--no-enable-prefix-caching")
HOST_KV_MODULE = "tokenflow.integrations.vllm.host_kv"


class PlatformLike(Protocol):
    """What the launcher asks of `vllm.platforms.current_platform`."""

    def is_cuda_alike(self) -> bool: ...

    def is_xpu(self) -> bool: ...


def host_kv_transfer_config() -> dict[str, object]:
    """vLLM's `--kv-transfer-config` for the host KV connector (see host_kv.py)."""
    return {
        "kv_connector": "HostKVConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": HOST_KV_MODULE,
    }


def offloading_transfer_config() -> dict[str, object]:
    """vLLM's `--kv-transfer-config` for its own `OffloadingConnector`, storing decoded blocks
    too (its `offload_prompt_only` defaults to true); `--kv-offloading-size` sizes the pool."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"offload_prompt_only": False},
    }


def vllm_offloads_here(platform: PlatformLike | None = None) -> bool:
    """True where vLLM's `OffloadingConnector` runs: CUDA-alike and XPU platforms, the test in
    vLLM 0.32's `CPUOffloadingSpec.get_worker` (`v1/kv_offload/cpu/spec.py`)."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    return bool(platform.is_cuda_alike() or platform.is_xpu())


def connector_args(vllm_args: Sequence[str], vllm_offloads: bool) -> list[str]:
    """The flags that add this platform's KV offload connector, unless `vllm_args` choose one."""
    flags = {arg.split("=")[0] for arg in vllm_args}
    if flags & set(CONNECTOR_FLAGS):
        return []
    if not vllm_offloads:
        if OFFLOADING_SIZE_FLAG in flags:
            return []  # vLLM's choice, which does not run on a CPU (docs/vllm.md)
        return ["--kv-transfer-config", json.dumps(host_kv_transfer_config())]
    args = ["--kv-transfer-config", json.dumps(offloading_transfer_config())]
    if OFFLOADING_SIZE_FLAG not in flags:
        args += [OFFLOADING_SIZE_FLAG, str(DEFAULT_OFFLOADING_GIB)]
    if not flags & set(PREFIX_CACHING_FLAGS):
        args.append("--enable-prefix-caching")
    return args


def vllm_server_args(argv: Sequence[str], vllm_offloads: bool = False) -> list[str]:
    """vLLM server arguments for `argv` (ours: `--default-rate`, `--no-host-kv`; the rest go to
    vLLM as given), on a platform where vLLM's own offloading runs (`vllm_offloads`) or not.

    ValueError when `--additional-config` is not a JSON object.
    """
    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    parser.add_argument("--default-rate", type=float, default=None)
    parser.add_argument("--additional-config", default=None)
    parser.add_argument("--no-host-kv", action="store_true")
    ours, rest = parser.parse_known_args(list(argv))
    args = ["--scheduler-cls", SCHEDULER_CLS, "--middleware", MIDDLEWARE, *rest]
    if not ours.no_host_kv:  # pauses offload to host memory
        args += connector_args(rest, vllm_offloads)
    extra = json.loads(ours.additional_config) if ours.additional_config else {}
    if not isinstance(extra, dict):
        raise ValueError("--additional-config must be a JSON object")
    if ours.default_rate is not None:
        extra.setdefault("tokenflow", {})["default_rate"] = ours.default_rate
    if extra:
        args += ["--additional-config", json.dumps(extra)]
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Run vLLM's API server in this process with TokenFlow's scheduler."""
    try:
        args = vllm_server_args(sys.argv[1:] if argv is None else argv, vllm_offloads_here())
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    sys.argv = [VLLM_SERVER_MODULE, *args]
    runpy.run_module(VLLM_SERVER_MODULE, run_name="__main__", alter_sys=True)


def launch(argv: Sequence[str], vllm_python: str | None = None) -> None:
    """Entry point for `tokenflow serve --engine vllm [--vllm-python PY] ARGS`: run the server
    here when this interpreter has vLLM and no other is named, else replace this process by
    `PY -m tokenflow.integrations.vllm.serve ARGS` (vLLM usually lives in its own venv), with
    this checkout of `tokenflow` on PYTHONPATH.  Never returns; SystemExit(2) when no vLLM."""
    if vllm_python is None:
        if importlib.util.find_spec("vllm") is None:
            print("error: vLLM is not installed here: pip install 'tokenflow[vllm]', or name "
                  "a Python that has it with --vllm-python", file=sys.stderr)  # fmt: skip
            raise SystemExit(2)
        main(argv)
        raise SystemExit(0)
    root = str(Path(__file__).resolve().parents[3])  # the directory holding `tokenflow/`
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    os.execve(vllm_python, [vllm_python, "-m", SERVE_MODULE, *argv], env)


if __name__ == "__main__":
    main()
