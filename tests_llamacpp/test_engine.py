"""The whole engine on the llama.cpp executor: the TokenFlow policy pauses and resumes streams
without changing a token, and the OpenAI server streams from it."""

from __future__ import annotations

import openai

from tests.serving.live_server import serve_in_thread
from tests_llamacpp.conftest import agrees_but_at_a_near_tie
from tokenflow import LLM
from tokenflow.core.request import SamplingParams
from tokenflow.engine.async_engine import AsyncEngine
from tokenflow.engine.engine_args import EngineArgs
from tokenflow.integrations.executors import executor_factory
from tokenflow.serving.app import build_app

NUM_NEW = 24


def test_preempted_streams_keep_their_tokens(gguf, oracle):
    tokenizer = gguf.tokenizer
    texts = [f"Tell me fact number {i} about the ocean." for i in range(8)]
    prompts = [tokenizer.encode(t) for t in texts]
    llm = LLM(
        executor="llama-cpp",
        device="cpu",
        policy="tokenflow",
        device_kv_tokens=128,  # 8 blocks: about four of the eight streams at once
        block_size=16,
        max_num_seqs=8,
        num_threads=2,
    )
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, min_tokens=NUM_NEW)
    outputs = llm.generate(prompts, params, rate_tps=2.0)
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions_total > 0  # streams took turns on the device
    exact = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        [choice] = output.outputs
        assert choice.finish_reason == "length"
        reference, margins = oracle.with_margins(prompt, NUM_NEW)
        assert agrees_but_at_a_near_tie(choice.token_ids, reference, margins)
        exact += choice.token_ids == reference
    assert exact >= 1
    llm.engine.close()


def test_openai_client_streams_from_llamacpp():
    args = EngineArgs(executor="llama-cpp", device="cpu", num_threads=2, device_kv_tokens=1024)
    engine = AsyncEngine(args, build_executor=executor_factory(args.executor))
    try:
        with serve_in_thread(build_app(engine)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            stream = client.completions.create(
                model=engine.model_name,
                prompt="The capital of France is",
                max_tokens=8,
                temperature=0,
                stream=True,
                extra_body={"stream_rate": 20},
            )
            pieces = list(stream)
            text = "".join(p.choices[0].text for p in pieces)
            assert "Paris" in text
            assert pieces[-1].choices[0].finish_reason in ("length", "stop")
    finally:
        engine.close()
