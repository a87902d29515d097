"""vLLM's `serve` command line on ours: its flags parse to the configuration ours give, the model
may come first, and a model hub's id is one clear error before anything loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import tokenizers

from tests.serving.fake_engine import FakeEngine
from tokenflow.cli.main import build_parser
from tokenflow.cli.serve_options import ServeOptions, serve_options_from
from tokenflow.model.config import ModelLoadError
from tokenflow.model.tokenizer import Tokenizer
from tokenflow.serving.app import build_app
from tokenflow.serving.config import ServerConfig


def serve(*argv: str) -> ServeOptions:
    return serve_options_from(build_parser("serve").parse_args(["serve", *argv]))


@pytest.fixture
def model_dir(tmp_path: Path) -> str:
    return str(tmp_path)  # an existing path (nothing loads while the options are built)


def test_the_model_may_come_first_as_in_vllm(model_dir):
    assert serve(model_dir) == serve("--model", model_dir)
    assert serve(model_dir).engine_args.model == model_dir
    assert serve(model_dir, "--model", model_dir).engine_args.model == model_dir
    with pytest.raises(ValueError, match="given twice"):
        serve(model_dir, "--model", model_dir + "/other")


@pytest.mark.parametrize(
    "vllm, ours",
    [
        (["--api-key", "a", "b"], ["--api-key", "a", "--api-key", "b"]),
        (["--max-num-seqs", "8"], ["--max-num-seqs=8"]),
        (["--max-model-len", "512"], ["--max-model-len=512"]),
        (["--host", "0.0.0.0", "--port", "9000"], ["--host=0.0.0.0", "--port=9000"]),
    ],
)  # fmt: skip
def test_each_vllm_spelling_builds_what_ours_does(model_dir, vllm, ours):
    assert serve(model_dir, *vllm) == serve(model_dir, *ours) != serve(model_dir)


def test_the_vllm_flags_reach_their_fields(model_dir):
    options = serve(model_dir, "--api-key", "a", "b", "--max-num-seqs", "8", "--port", "9000")
    assert options.config.allowed_keys == ("a", "b") and options.config.port == 9000
    assert options.engine_args.max_num_seqs == 8
    assert serve(model_dir, "--max-model-len", "1024").engine_args.max_model_len == 1024
    names = serve(model_dir, "--served-model-name", "a", "b").config.served_model_names
    assert names == ("a", "b") and serve(model_dir).config.served_model_names == ()


def test_a_hub_id_is_refused_before_anything_loads(tmp_path):
    probe = (
        "import json, sys\n"
        "from tokenflow.cli.main import main\n"
        "code = main(['serve', 'Qwen/Qwen3-0.6B'])\n"
        "print(json.dumps([code, sorted(sys.modules)]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    code, modules = json.loads(done.stdout)
    assert code == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not download from model hubs" in lines[0]
    assert "huggingface-cli download Qwen/Qwen3-0.6B --local-dir DIR" in lines[0]
    heavy = [m for m in modules if m.split(".")[0] in ("torch", "transformers", "xgrammar")]
    assert heavy == [] and "tokenflow.model" not in modules


def test_a_missing_gguf_file_or_an_existing_directory_is_no_hub_id(tmp_path):
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert serve(str(tmp_path / "org" / "name")).engine_args.model.endswith("org/name")
    assert serve("models/missing.gguf").engine_args.model == "models/missing.gguf"


def test_a_chat_template_from_a_file_or_as_text(model_dir, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    from_file = serve(model_dir, "--chat-template", str(path)).engine_args.chat_template
    assert from_file == path.read_text()
    text = "{{ messages[0].content }}!"
    assert serve(model_dir, "--chat-template", text).engine_args.chat_template == text
    assert serve(model_dir).engine_args.chat_template is None
    with pytest.raises(ValueError, match="does not exist"):
        serve(model_dir, "--chat-template", str(tmp_path / "missing.jinja"))


def _tokenizer(chat_template: str | None) -> Tokenizer:
    vocab = {"[UNK]": 0, "hi": 1}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    return Tokenizer(backend, eos_token_id=None, chat_template=chat_template)


def test_the_chat_template_replaces_the_models():
    own = _tokenizer("<{{ messages[0].content }}>")
    replaced = own.with_chat_template("[{{ messages[0].content }}]")
    assert own.render_chat([{"role": "user", "content": "hi"}]) == "<hi>"
    assert replaced.render_chat([{"role": "user", "content": "hi"}]) == "[hi]"
    assert own.with_chat_template(None) is own
    with pytest.raises(ModelLoadError, match="does not compile"):
        own.with_chat_template("{% for %}")


def test_the_engine_renders_chats_with_the_given_template(tiny_model_dir):
    from tokenflow.engine.engine_args import EngineArgs
    from tokenflow.engine.llm_engine import LLMEngine

    template = "USER SAID {{ messages[0].content }}"
    args = EngineArgs(model=tiny_model_dir, device="cpu", max_model_len=256, chat_template=template)
    engine = LLMEngine(args)
    assert engine.tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "USER SAID hi"


@pytest.mark.anyio
async def test_every_served_model_name_is_listed_and_served():
    app = build_app(FakeEngine(), ServerConfig(served_model_names=("a", "b")))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        listed = (await http.get("/v1/models")).json()["data"]
        assert [card["id"] for card in listed] == ["a", "b"]
        assert (await http.get("/v1/models/b")).json()["id"] == "b"
        body = {"model": "b", "prompt": "x", "max_tokens": 1}
        answer = await http.post("/v1/completions", json=body)
        assert answer.status_code == 200 and answer.json()["model"] == "a"
        other = await http.post("/v1/completions", json={**body, "model": "fake-model"})
        assert other.status_code == 404
        assert other.json()["error"]["code"] == "model_not_found"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
