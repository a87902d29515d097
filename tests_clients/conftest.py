"""One live `tokenflow serve` on the embedded SmolLM2 for the whole suite, driven by the clients
users bring (the openai SDK, langchain-openai, lm-eval, `vllm bench serve`).

Several tests compare one client's answer with another's for the same greedy request (a prompt
alone against the same prompt in a batch), so the server runs dense float32 weights on one
thread: there greedy tokens do not depend on what else is in the batch (docs/reliability.md).
The context and tiers are small, so it starts in seconds, and keep-alives come after 0.2 s of
silence, so a stream that waits (for a batch slot, a long prefill) carries them to its client.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tokenflow.eval.local_server import RunningServer, free_port, running_server, serve_command

MAX_MODEL_LEN = 1024
DEVICE_KV_TOKENS = 4096
SERVE_ARGS = (
    "--dtype", "float32", "--num-threads", "1", "--max-model-len", str(MAX_MODEL_LEN),
    "--device-kv-tokens", str(DEVICE_KV_TOKENS), "--host-kv-tokens", "8192", "--max-num-seqs", "8",
    "--keepalive-s", "0.2",
)  # fmt: skip


@pytest.fixture(scope="session")
def server() -> Iterator[RunningServer]:
    """The live server (its root URL and model id)."""
    port = free_port()
    with running_server(serve_command(port, SERVE_ARGS), port, name="tokenflow") as running:
        assert running.model_id is not None, "the server lists no model on /v1/models"
        yield running


@pytest.fixture(scope="session")
def base_url(server: RunningServer) -> str:
    """The OpenAI base URL of the live server, e.g. http://127.0.0.1:PORT/v1."""
    return f"{server.url}/v1"


@pytest.fixture(scope="session")
def model_id(server: RunningServer) -> str:
    """The id of the one model the server runs."""
    assert server.model_id is not None
    return server.model_id


@pytest.fixture(scope="session")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    """The official openai SDK, no retries (a failure shows at once)."""
    with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120) as sdk:
        yield sdk
