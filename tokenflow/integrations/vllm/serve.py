"""Launch vLLM's OpenAI server with TokenFlow's scheduler and `stream_rate` support.

    python -m tokenflow.integrations.vllm.serve --model DIR [--default-rate R] [--no-host-kv]
        [vLLM flags...]

is the same as

    python -m vllm.entrypoints.openai.api_server --model DIR [vLLM flags...] \\
        --scheduler-cls tokenflow.integrations.vllm.TokenFlowScheduler \\
        --middleware tokenflow.integrations.vllm.middleware.StreamRateMiddleware \\
        --kv-transfer-config '{"kv_connector": "HostKVConnector", "kv_role": "kv_both",
            "kv_connector_module_path": "tokenflow.integrations.vllm.host_kv"}' \\
        [--additional-config '{"tokenflow": {"default_rate": R}}']

The host KV connector (paused streams' KV kept in host memory) is left out with `--no-host-kv`
or when the vLLM flags already choose a connector (`--kv-transfer-config`,
`--kv-offloading-size`); pauses are then recomputes.

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

SCHEDULER_CLS = "tokenflow.integrations.vllm.TokenFlowScheduler"
MIDDLEWARE = "tokenflow.integrations.vllm.middleware.StreamRateMiddleware"
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
SERVE_MODULE = "tokenflow.integrations.vllm.serve"
# vLLM flags that choose a KV connector: the user's choice then replaces our host KV connector.
CONNECTOR_FLAGS = ("--kv-transfer-config", "--kv-offloading-size")
HOST_KV_MODULE = "tokenflow.integrations.vllm.host_kv"


def host_kv_transfer_config() -> dict[str, object]:
    """vLLM's `--kv-transfer-config` for the host KV connector (see host_kv.py)."""
    return {
        "kv_connector": "HostKVConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": HOST_KV_MODULE,
    }


def vllm_server_args(argv: Sequence[str]) -> list[str]:
    """vLLM server arguments for `argv` (ours: `--default-rate`; the rest go to vLLM as given).

    ValueError when `--additional-config` is not a JSON object.
    """
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--default-rate", type=float, default=None)
    parser.add_argument("--additional-config", default=None)
    parser.add_argument("--no-host-kv", action="store_true")
    ours, rest = parser.parse_known_args(list(argv))
    args = ["--scheduler-cls", SCHEDULER_CLS, "--middleware", MIDDLEWARE, *rest]
    has_connector = any(a.split("=")[0] in CONNECTOR_FLAGS for a in rest)
    if not (ours.no_host_kv or has_connector):  # pauses offload to host memory
        args += ["--kv-transfer-config", json.dumps(host_kv_transfer_config())]
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
        args = vllm_server_args(sys.argv[1:] if argv is None else argv)
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
