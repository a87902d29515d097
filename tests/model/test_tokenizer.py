"""Tokenizers (SmolLM2's GGUF one, tokenizer.json), streaming detokenization, stop strings."""

from __future__ import annotations

import json
import random

import jinja2
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenflow.model import IncrementalDetokenizer, Tokenizer, find_stop, partial_stop_length
from tokenflow.model.tokenizer import StopMatcher

TEXTS = [
    "Hello world",
    "  leading spaces\n\ttabs and\n\nnewlines   ",
    "héllo wörld — 日本語のテキスト 🤖🎉 émoji",
    "numbers 12345, 3.14159 and 2024-01-01",
    "don't you'll I'M we've",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(smollm, hf_smollm_tokenizer, text):
    ours = smollm.tokenizer
    expected = hf_smollm_tokenizer(text).input_ids
    assert ours.encode(text) == expected
    assert ours.decode(expected) == hf_smollm_tokenizer.decode(expected, skip_special_tokens=True)


def test_chat_template_renders_chatml(smollm, hf_smollm_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    text = smollm.tokenizer.render_chat(messages)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    expected = hf_smollm_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert smollm.tokenizer.apply_chat_template(messages) == list(expected)
    assert smollm.tokenizer.eos_token_id == 2  # <|im_end|>


def test_incremental_detokenizer_never_splits_a_character(smollm):
    tokenizer = smollm.tokenizer
    text = "Grüße 🤖🎉 日本語 and plain text 👍🏽!"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([token]) for token in ids]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) + detok.flush() == text
    assert detok.text == text


def test_incremental_detokenizer_keeps_leading_space_after_prompt(smollm):
    tokenizer = smollm.tokenizer
    prompt = tokenizer.encode("The answer is")
    continuation = tokenizer.encode(" forty two")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(detok.push([t]) for t in continuation) == " forty two"


def test_flush_emits_an_incomplete_character(smollm):
    tokenizer = smollm.tokenizer
    ids = tokenizer.encode("🤖")
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids[:-1]) == ""  # held back: the character is incomplete
    assert detok.flush() == tokenizer.decode(ids[:-1])


def test_find_stop():
    assert find_stop("Hello world. Bye", [".", "Bye"]) == 11
    assert find_stop("Hello", ["x", ""]) is None
    assert find_stop("a.b.c", ["."], search_from=2) == 3


def test_partial_stop_length():
    assert partial_stop_length("Hello wor", ["world"]) == 3
    assert partial_stop_length("Hello", ["world"]) == 0
    assert partial_stop_length("x<|im", ["<|im_end|>", "<"]) == 4


def _whole_text_reference(text: str, stops: tuple[str, ...], fed_before: int):
    """Brute force on the whole text: where the earliest stop that ends past `fed_before`
    starts (None if none), and the longest suffix that is a proper prefix of a stop."""
    starts = [
        i
        for stop in stops
        if stop
        for i in range(len(text) - len(stop) + 1)
        if text.startswith(stop, i) and i + len(stop) > fed_before
    ]
    held = [n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])]
    return min(starts, default=None), max(held, default=0)


def _check_feeds(pieces: list[str], stops: tuple[str, ...]) -> None:
    """Feed `pieces`; after each, the matcher agrees with the reference, and with the old
    whole-text functions (find_stop only up to the first stop: the stream ends there)."""
    matcher, text, stopped = StopMatcher(stops), "", False
    for piece in pieces:
        cut = matcher.feed(piece)
        fed_before, text = len(text), text + piece
        assert (cut, matcher.partial_length) == _whole_text_reference(text, stops, fed_before)
        assert matcher.partial_length == partial_stop_length(text, stops)
        if not stopped:
            assert cut == find_stop(text, stops)
            stopped = cut is not None
    assert matcher.num_fed_chars == len(text)


def _splits(text: str) -> list[list[str]]:
    """One character per feed, all at once, pieces of 2 and 3, and empty feeds in between."""
    pieces = [[text[i : i + n] for i in range(0, len(text), n)] for n in (1, 2, 3)]
    return [*pieces, [text], ["", *" ".join(text).split(" "), ""]]


@pytest.mark.parametrize(
    ("text", "stops"),
    [
        ("xabcdy", ("abcd", "bc")),  # overlapping: the one that ends first stops a stream
        ("abcde", ("abcde", "cd")),  # fed at once: the earliest start wins, as in find_stop
        ("xabcz", ("abc", "ab")),  # a stop that is a prefix of another
        ("aaab aabab", ("aab", "abab", "b a")),  # matches that need failure links
        ("say <|im_end|> and more", ("<|im_end|>", "<|im_start|>")),  # split over many feeds
        ("x<|im", ("<|im_end|>", "<")),
        ("Grüße 🤖 aus 日本語!", ("日本語", "🤖 a", "ße", "語?")),  # unicode
        ("no stop here", ("", "zz", "herex")),  # empty stops are ignored
        ("aXa", ("a", "a")),  # duplicates
        ("", ("a",)),
    ],
)
def test_stop_matcher_equals_the_whole_text_functions(text, stops):
    for pieces in _splits(text):
        _check_feeds(pieces, stops)


_ALPHABET = "abé🤖"


@settings(max_examples=400, deadline=None, database=None)
@given(
    stops=st.lists(st.text(_ALPHABET, max_size=5), min_size=1, max_size=4).map(tuple),
    pieces=st.lists(st.text(_ALPHABET + " ", max_size=6), max_size=12),
)
def test_stop_matcher_equals_the_reference_on_random_feeds(stops, pieces):
    _check_feeds(pieces, stops)


@pytest.mark.parametrize("kind", ["shared prefix", "random"])
def test_stop_matcher_work_is_bounded_by_the_characters_fed(kind):
    """16 stops of 256 characters (the request limits), 1,000 one-character feeds: at most 2
    trie lookups per character fed, however long the stops and the text so far (the old
    functions compared every stop's prefixes with the text's tail on every feed)."""
    rng = random.Random(0)
    if kind == "shared prefix":  # deep nodes, and failure chains as long as they get
        stops = tuple("a" * 255 + chr(ord("b") + i) for i in range(16))
        text = "".join("a" * rng.randrange(400) + rng.choice("bcz") for _ in range(20))[:1000]
    else:
        stops = tuple("".join(rng.choice("abc") for _ in range(256)) for _ in range(16))
        text = "".join(rng.choice("abc") for _ in range(1000))
    matcher = StopMatcher(stops)
    for char in text:
        matcher.feed(char)
    assert matcher.num_fed_chars == len(text) == 1000
    assert matcher.num_steps <= 2 * len(text)


def test_saved_directory_reads_back_as_the_same_tokenizer(smollm, tmp_path):
    tokenizer = smollm.tokenizer
    tokenizer.save_directory(tmp_path)
    again = Tokenizer.from_directory(tmp_path)
    text = "Hello, world! Ünïcödé and <|im_end|>"
    assert again.encode(text) == tokenizer.encode(text)
    assert (again.eos_token_id, again.bos_token, again.eos_token) == (
        tokenizer.eos_token_id, tokenizer.bos_token, tokenizer.eos_token
    )  # fmt: skip
    messages = [{"role": "user", "content": "Hi"}]
    assert again.apply_chat_template(messages) == tokenizer.apply_chat_template(messages)


def test_tokenizer_from_directory(tmp_path):
    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4, "Ġ": 5}
    model = tokenizers.models.BPE(vocab=vocab, merges=[("a", "b")])
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_directory(tmp_path)
    assert tokenizer.encode("ab ab") == [4, 5, 4]
    assert tokenizer.eos_token_id == 1
    assert tokenizer.apply_chat_template([{"role": "user", "content": "ab"}]) == [0, 4, 1]
    assert Tokenizer.from_directory(tmp_path / "missing") is None


def test_chat_template_is_sandboxed(tmp_path):
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={"a": 0}, merges=[]))
    unsafe = "{{ messages.__class__.__mro__ }}"
    tokenizer = Tokenizer(backend, None, chat_template=unsafe)
    with pytest.raises(Exception, match="unsafe|access"):
        tokenizer.render_chat([{"role": "user", "content": "a"}])


class _WindowDetokenizer:
    """The reference: two full window decodes per push (the detokenizer before DecodeStream)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-5:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def flush(self) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        return self.tokenizer.decode(self.ids[self.prefix_offset :])[len(prefix) :]


def _streams(tokenizer: Tokenizer, prompt: list[int], pushes: list[list[int]]):
    ours = IncrementalDetokenizer(tokenizer, prompt)
    reference = _WindowDetokenizer(tokenizer, prompt)
    got = [ours.push(p) for p in pushes] + [ours.flush()]
    expected = [reference.push(p) for p in pushes] + [reference.flush()]
    return got, expected


@pytest.mark.parametrize("text", TEXTS + ["🤖", "a<|im_end|>b 日本<|endoftext|>語 é"])
def test_incremental_detokenizer_equals_the_window_reference(smollm, text):
    tokenizer = smollm.tokenizer
    prompt = tokenizer.encode("Say something:")
    ids = tokenizer.encode(text)
    got, expected = _streams(tokenizer, prompt, [[t] for t in ids])
    assert got == expected
    for cut in (1, 2, 3):  # incomplete characters left for flush
        got, expected = _streams(tokenizer, prompt, [[t] for t in ids[:-cut]])
        assert got == expected
    pairs = [ids[i : i + 2] for i in range(0, len(ids), 2)]  # two tokens per step
    got, expected = _streams(tokenizer, [], pairs)
    assert got == expected


@pytest.mark.parametrize("seed", range(4))
def test_incremental_detokenizer_equals_the_reference_on_random_ids(smollm, seed):
    """Random ids: stray UTF-8 continuation bytes, special tokens, odd spacing."""
    import random

    rng = random.Random(seed)
    tokenizer = smollm.tokenizer
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(300)]
    prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(8)]
    got, expected = _streams(tokenizer, prompt, [[t] for t in ids])
    assert got == expected


THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)


def _chat_tokenizer() -> Tokenizer:
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={"a": 0}, merges=[]))
    return Tokenizer(backend, None, chat_template=THINKING_TEMPLATE)


def test_chat_template_kwargs_reach_the_template_and_cannot_replace_its_variables():
    tokenizer = _chat_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.render_chat(messages) == "<|user|>hi<|end|><|assistant|>"
    off = tokenizer.render_chat(messages, chat_template_kwargs={"enable_thinking": False})
    assert off == "<|user|>hi<|end|><|assistant|><think></think>"
    ours = {"messages": [], "add_generation_prompt": False}
    assert tokenizer.render_chat(messages, chat_template_kwargs=ours) == (
        "<|user|>hi<|end|><|assistant|>"
    )


def test_continue_final_message_leaves_the_last_message_open():
    tokenizer = _chat_tokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The an"}]
    rendered = tokenizer.render_chat(messages, add_generation_prompt=False)
    assert rendered.endswith("The an<|end|>")
    opened = tokenizer.render_chat(
        messages, add_generation_prompt=False, continue_final_message=True
    )
    assert opened == "<|user|>hi<|end|><|assistant|>The an"


def test_continue_final_message_refuses_a_template_that_hides_the_message():
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={"a": 0}, merges=[]))
    tokenizer = Tokenizer(backend, None, chat_template="{% for m in messages %}x{% endfor %}")
    messages = [{"role": "assistant", "content": "The an"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="final message"):
        tokenizer.render_chat(messages, add_generation_prompt=False, continue_final_message=True)
