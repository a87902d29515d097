"""lm-eval's `local-completions` against the live server, on the two tiny local tasks of
tasks/ (a generate_until one and a multiple_choice one), with the server's own tokenizer
(`tokenizer_backend=remote`: /tokenizer_info, /tokenize, /detokenize), token-id requests and
batches of 4.  Scores are not checked, only that the run ends with numbers, and that what
lm-eval recorded is what the server answers to the same request made alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests_clients.answers import greedy_completion
from tests_clients.conftest import MAX_MODEL_LEN

pytest.importorskip("lm_eval", reason="the `clients` extra")

TASKS_DIR = Path(__file__).parent / "tasks"
GENERATE_TASK = "tokenflow_arithmetic"
CHOICE_TASK = "tokenflow_capitals"
BATCH_SIZE = 4
RUN_TIMEOUT_S = 280  # lm-eval's start (its imports) is most of it


@dataclass(frozen=True)
class LmEvalRun:
    """One lm-eval run's results.json and each task's logged samples."""

    results: dict
    samples: dict[str, list[dict]]


def _data_file(task: str) -> Path:
    """The local dataset a task YAML names (its `dataset_kwargs.data_files.test`)."""
    import yaml

    config = yaml.safe_load((TASKS_DIR / f"{task}.yaml").read_text())
    return TASKS_DIR / config["dataset_kwargs"]["data_files"]["test"]


@pytest.fixture(scope="module")
def lm_eval_run(base_url: str, model_id: str, tmp_path_factory: pytest.TempPathFactory):
    """Both tasks in one `lm_eval` run, offline; its results and samples."""
    out = tmp_path_factory.mktemp("lm-eval")
    model_args = ",".join(
        [
            f"base_url={base_url}/completions",
            f"model={model_id}",
            "tokenizer_backend=remote",
            "tokenized_requests=True",
            f"max_length={MAX_MODEL_LEN}",
            "max_retries=1",
        ]
    )
    command = [
        sys.executable, "-m", "lm_eval", "--model", "local-completions",
        "--model_args", model_args, "--tasks", f"{GENERATE_TASK},{CHOICE_TASK}",
        "--include_path", str(TASKS_DIR), "--batch_size", str(BATCH_SIZE),
        "--output_path", str(out / "results"), "--log_samples",
    ]  # fmt: skip
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(out)}
    done = subprocess.run(
        command,
        cwd=TASKS_DIR,  # the YAMLs name their data files relative to it
        env={**os.environ, **offline},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    (results_path,) = (out / "results").rglob("results_*.json")
    samples = {
        task: [json.loads(line) for line in path.read_text().splitlines()]
        for task in (GENERATE_TASK, CHOICE_TASK)
        for path in (out / "results").rglob(f"samples_{task}_*.jsonl")
    }
    return LmEvalRun(json.loads(results_path.read_text()), samples)


@pytest.mark.parametrize(("task", "metric"), [(GENERATE_TASK, "exact_match"), (CHOICE_TASK, "acc")])
def test_lm_eval_task_ends_with_a_score_over_every_doc(
    lm_eval_run: LmEvalRun, task: str, metric: str
) -> None:
    score = lm_eval_run.results["results"][task][f"{metric},none"]
    assert isinstance(score, float) and 0.0 <= score <= 1.0
    num_docs = len(_data_file(task).read_text().splitlines())
    assert lm_eval_run.results["n-samples"][task]["effective"] == num_docs
    assert len(lm_eval_run.samples[task]) == num_docs


def test_lm_eval_generations_are_the_servers_greedy_answers(
    lm_eval_run: LmEvalRun, client: openai.OpenAI, model_id: str
) -> None:
    # lm-eval sent them as token ids in batches of 4: each must be its own prompt's answer.
    for sample in lm_eval_run.samples[GENERATE_TASK]:
        prompt, gen_kwargs = sample["arguments"]["gen_args_0"].values()
        alone = greedy_completion(
            client, model_id, prompt, gen_kwargs["max_gen_toks"], stop=gen_kwargs["until"]
        )
        assert sample["resps"] == [[alone]], sample["doc"]


def _continuation_logprob(client: openai.OpenAI, model_id: str, context: str, rest: str) -> float:
    """The server's logprob of `rest` after `context`: its echoed prompt tokens past the
    context, summed."""
    answer = client.completions.create(
        model=model_id, prompt=context + rest, max_tokens=0, echo=True, logprobs=0
    )
    logprobs = answer.choices[0].logprobs
    return sum(
        logprob
        for offset, logprob in zip(logprobs.text_offset, logprobs.token_logprobs, strict=True)
        if offset >= len(context)
    )


def test_lm_eval_loglikelihoods_are_the_servers_prompt_logprobs(
    lm_eval_run: LmEvalRun, client: openai.OpenAI, model_id: str
) -> None:
    for sample in lm_eval_run.samples[CHOICE_TASK]:
        for arguments, response in zip(sample["arguments"].values(), sample["resps"], strict=True):
            context, continuation = arguments["arg_0"], arguments["arg_1"]
            recorded = float(response[0][0])
            expected = _continuation_logprob(client, model_id, context, continuation)
            # Up to float32 rounding, which differs between batch shapes; the context's last
            # token or the generated one counted in would move the sum by far more.
            assert recorded == pytest.approx(expected, rel=1e-3, abs=1e-3), continuation
