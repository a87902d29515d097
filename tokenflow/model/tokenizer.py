"""Tokenizers for the engine: from `tokenizer.json` or rebuilt from GGUF metadata.

Also the streaming helpers: `IncrementalDetokenizer` turns token ids into text deltas without
splitting a multi-byte character, and `StopMatcher` finds stop strings in a stream fed piece by
piece (`find_stop` / `partial_stop_length` do the same on a whole text).
"""

from __future__ import annotations

import functools
import json
from array import array
from collections import deque
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import decoders, pre_tokenizers, processors

from tokenflow.model.config import ModelLoadError

_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's `tokenizer.ggml.pre` -> the split regex its merges were learned with.
_GGUF_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4


class Tokenizer:
    """Text <-> token ids, and chat rendering; satisfies the serving layer's Tokenizer protocol."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        eos_token_id: int | None,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self.backend = backend
        self.eos_token_id = eos_token_id
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template else None

    def with_chat_template(self, chat_template: str | None) -> Tokenizer:
        """This tokenizer rendering chats with `chat_template` (Jinja text) instead of its own
        (None: itself); ModelLoadError when the template does not compile."""
        if chat_template is None:
            return self
        try:
            return Tokenizer(
                self.backend, self.eos_token_id, chat_template, self.bos_token, self.eos_token
            )
        except jinja2.TemplateSyntaxError as err:
            raise ModelLoadError(f"the chat template does not compile: {err}") from None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the vocabulary's longest token (its byte-level or metaspace form,
        never shorter than its text): n tokens hold at most n times this many characters."""
        return max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the tokenizer's own special tokens (e.g. a BOS) if any
        (unless `add_special_tokens` is false).

        Through `encode_batch`, which releases the GIL while it works (`encode` holds it: a
        650k-character text froze every other thread of the server for about 0.35 s here);
        the ids are the same."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `token_ids`; special tokens are left out unless asked for."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def added_token_texts(self) -> dict[int, str]:
        """The added tokens (special ones included) by id: their text as written."""
        return {i: t.content for i, t in self.backend.get_added_tokens_decoder().items()}

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template has a tools section (it reads `tools`, tool messages or
        assistant `tool_calls`); without one they cannot be shown to the model."""
        return self.chat_template is not None and "tool" in self.chat_template

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat template applied to `messages` (and `tools`, for a template with a tools
        section), ending with the assistant's turn opener (unless `add_generation_prompt` is
        false), or, with `continue_final_message`, cut right after the last message's text
        (what Hugging Face's `apply_chat_template` does), for the model to continue it.
        `chat_template_kwargs` are further variables for the template (e.g. `enable_thinking`);
        the ones set here (messages, tools, the turn opener, BOS and EOS) take precedence."""
        if self._template is None:
            raise ValueError("this tokenizer has no chat template")
        variables = dict(chat_template_kwargs or {})
        if tools is not None:
            variables["tools"] = [dict(t) for t in tools]
        rendered = self._template.render(
            variables,
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        if continue_final_message:
            return _cut_after_final_message(rendered, messages)
        return rendered

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Render OpenAI-style messages with the chat template (`render_chat`) and tokenize
        them (no extra BOS)."""
        options: dict[str, Any] = {"continue_final_message": continue_final_message}
        options["chat_template_kwargs"] = chat_template_kwargs
        text = self.render_chat(messages, tools, add_generation_prompt, **options)
        return self.encode(text, add_special_tokens=False)

    @classmethod
    def from_directory(cls, directory: str | Path) -> Tokenizer | None:
        """Load `tokenizer.json` (+ `tokenizer_config.json`); None when there is no tokenizer."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            return None
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
            config = _read_json(directory / "tokenizer_config.json")
        except Exception as exc:  # tokenizers raises plain Exception on bad JSON
            raise ModelLoadError(f"cannot read tokenizer {path}: {exc}") from exc
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        jinja_path = directory / "chat_template.jinja"
        if jinja_path.is_file():
            template = jinja_path.read_text(encoding="utf-8")
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        eos_id = backend.token_to_id(eos) if eos else None
        return cls(backend, eos_id, template, bos, eos)

    def save_directory(self, directory: str | Path) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` (chat template, BOS and EOS
        tokens): what `from_directory` reads back."""
        directory = Path(directory)
        self.backend.save(str(directory / "tokenizer.json"))
        config = {"chat_template": self.chat_template, "bos_token": self.bos_token}
        config["eos_token"] = self.eos_token
        (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Rebuild a byte-level BPE tokenizer ("gpt2" in llama.cpp terms) from GGUF metadata."""
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelLoadError(
                f"GGUF tokenizer model {model!r} is not supported; supported: 'gpt2' (byte BPE)"
            )
        tokens = list(metadata["tokenizer.ggml.tokens"])
        backend = _byte_level_bpe(tokens, list(metadata.get("tokenizer.ggml.merges", [])))
        backend.pre_tokenizer = _gguf_pre_tokenizer(str(metadata.get("tokenizer.ggml.pre", "")))
        _add_gguf_special_tokens(backend, tokens, metadata.get("tokenizer.ggml.token_type") or [])
        bos_id = metadata.get("tokenizer.ggml.bos_token_id")
        eos_id = metadata.get("tokenizer.ggml.eos_token_id")
        bos = tokens[bos_id] if bos_id is not None else None
        if bos is not None and metadata.get("tokenizer.ggml.add_bos_token", False):
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
            )
        eos = tokens[eos_id] if eos_id is not None else None
        template = metadata.get("tokenizer.chat_template")
        return cls(backend, eos_id, template, bos, eos)


def _byte_level_bpe(tokens: list[str], merges: list[str]) -> tokenizers.Tokenizer:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:  # respell a token stored as raw text
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=pairs))
    backend.decoder = decoders.ByteLevel()
    return backend


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # digits split one by one, then GPT-2 splitting
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = _GGUF_SPLITS.get(pre)
    if split is None:
        return byte_level  # GPT-2's own regex
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _add_gguf_special_tokens(
    backend: tokenizers.Tokenizer, tokens: list[str], token_types: Sequence[int]
) -> None:
    control = [t for t, kind in zip(tokens, token_types, strict=False) if kind == _GGUF_CONTROL]
    user = [t for t, kind in zip(tokens, token_types, strict=False) if kind == _GGUF_USER_DEFINED]
    backend.add_special_tokens([tokenizers.AddedToken(t, normalized=False) for t in control])
    backend.add_tokens([tokenizers.AddedToken(t, normalized=False) for t in user])


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as handle:
        return json.load(handle)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _cut_after_final_message(rendered: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """`rendered` up to the end of the last message's text (its last occurrence), so nothing
    the template closes a turn with follows; a TemplateError when the template does not show
    that text (a template that rewrites it cannot be continued)."""
    final = str(messages[-1].get("content") or "") if messages else ""
    stripped = final.strip()
    start = rendered.rfind(stripped) if stripped else -1
    if start < 0:
        raise jinja2.exceptions.TemplateError(
            "continue_final_message: the final message does not appear in the chat after "
            "applying the chat template"
        )
    kept = final.lstrip()  # with its trailing spaces, where the template kept them
    return rendered[: start + (len(kept) if rendered.startswith(kept, start) else len(stripped))]


def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, indent: int | None = None, **kwargs: Any) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent, **kwargs)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns one request's token ids into text deltas as they arrive.

    Each token is one call into the tokenizer library's `DecodeStream` (it decodes a small
    window: the previous emission's tokens plus the new ones, and emits what the new ones
    added); text that ends in an incomplete UTF-8 sequence ("\\ufffd") is held back until the
    character completes or until `flush`, which decodes the held tokens as they are.  Special
    tokens are left out, as in `Tokenizer.decode`, unless `skip_special_tokens` is false; then,
    without `spaces_between_special_tokens`, an added token that follows another is its text
    alone, with no space the decoder would put before it (vLLM's rule for these tokenizers).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        context_tokens: int = 5,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self._backend = tokenizer.backend
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids[-context_tokens:])  # context for leading spaces
        self._stream = decoders.DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._prefix_ids = context  # the tokens behind the latest emission (or the context)
        self._held_ids: list[int] = []  # pushed since then
        self.text = ""
        # The added tokens' texts where two of them join without a space (None: no joining).
        joins = not (skip_special_tokens or spaces_between_special_tokens)
        self._joined = tokenizer.added_token_texts if joins else None
        self._last_added = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Add new token ids; return the text they complete (possibly empty)."""
        if self._joined:
            return "".join([self._push_joined(token_id) for token_id in token_ids])
        if len(token_ids) == 1:  # the common case, one token per step: pass an int
            delta = self._stream.step(self._backend, token_ids[0])
        elif token_ids:
            delta = self._stream.step(self._backend, list(token_ids))
        else:
            return ""
        self._held_ids += token_ids
        return "" if delta is None else self._emit(delta)

    def _push_joined(self, token_id: int) -> str:
        assert self._joined is not None
        delta = self._stream.step(self._backend, token_id)
        self._held_ids.append(token_id)
        added = self._joined.get(token_id)
        if added is not None and self._last_added:
            delta = added
        self._last_added = added is not None
        return "" if delta is None else self._emit(delta)

    def flush(self) -> str:
        """Emit whatever is held back, incomplete characters included; ends the stream."""
        if not self._held_ids:
            return ""
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=self._skip_special)
        prefix = decode(self._prefix_ids)
        full = decode(self._prefix_ids + self._held_ids)
        return self._emit(full[len(prefix) :])

    def _emit(self, delta: str) -> str:
        self._prefix_ids = self._held_ids
        self._held_ids = []
        self.text += delta
        return delta


def find_stop(text: str, stops: Sequence[str], search_from: int = 0) -> int | None:
    """Index where the earliest stop string starts in `text` (at or after search_from), or None."""
    found = [i for i in (text.find(s, search_from) for s in stops if s) if i >= 0]
    return min(found) if found else None


def partial_stop_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that could still grow into a stop string.

    A streamer holds those characters back until the next delta decides them.
    """
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


class StopMatcher:
    """Finds stop strings in a stream that is fed only its new characters (Aho-Corasick).

    Why: `find_stop` + `partial_stop_length` rescan the text's tail against every stop string
    on every token.  With 16 stops of 256 characters (the request limits) that costs 0.5-2 ms
    per token per stream (0.003 ms for one short stop), so 32 such streams add 15-60 ms to
    every engine step, on the engine thread, for everybody.  Here each fed character costs one trie
    lookup plus one per failure link followed, and the failure links followed never outnumber
    the characters fed (each one shortens the current match, each character lengthens it by at
    most one): at most 2 lookups per character over the stream's life (`num_steps` counts
    them), whatever the number and length of the stops and the length of the text so far
    (~0.001 ms per 4-character token either way); building the automaton, once per request,
    is linear in the stops' total length (~5 ms for 16 x 256 characters, 0.015 ms for one).

    Invariant: after the characters T (`num_fed_chars` of them), `_node` is the trie node of the
    longest suffix of T that is a prefix of some stop.  The suffixes of T that are prefixes of
    stops are exactly `_node`'s failure chain, so each node knows the longest of them that is a
    whole stop (`_match`: a stop ends here) and the longest that is a proper prefix of a stop
    (`_hold`: what `partial_stop_length(T, stops)` returns).  Empty stops are ignored, as
    `find_stop` ignores them.

    The trie is compact (a few bytes per stop character, not a dict per node: a request may
    bring 16 x 256 characters): node `offset + d`, with `offset` the length of the stops before
    stop i, is stop i's prefix of length d, numbered in the first stop that has that prefix.
    Its child along stop i is the next number (character `_chars[node]`, where `_chained` is
    set); the first node of a stop past the prefix it shares with earlier ones is in
    `_branches` instead, under the shared prefix's node (the root is node 0).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self._chars = "".join(stops)
        self._chained = bytearray(len(self._chars) + 1)
        self._branches: dict[int, dict[str, int]] = {}
        depth, whole, offset = [0] * (len(self._chars) + 1), set(), 0
        for stop in stops:
            node, shared = 0, 0  # follow the trie so far as long as it has the stop's prefix
            while shared < len(stop) and (child := self._child(node, stop[shared])) is not None:
                node, shared = child, shared + 1
            if shared < len(stop):
                self._branches.setdefault(node, {})[stop[shared]] = node = offset + shared + 1
                for d in range(shared + 1, len(stop) + 1):
                    depth[offset + d] = d
                    self._chained[offset + d] = d < len(stop)
                node = offset + len(stop)
            if stop:
                whole.add(node)
            offset += len(stop)
        self._link_failures(depth, whole)
        self._node = 0
        self.num_fed_chars = 0
        self.num_steps = 0  # trie lookups so far: at most 2 * num_fed_chars
        self.stop_length = 0  # characters of the stop string `feed` found last

    def _child(self, node: int, char: str) -> int | None:
        if self._chained[node] and self._chars[node] == char:
            return node + 1
        branch = self._branches.get(node)
        return None if branch is None else branch.get(char)

    def _children(self, node: int) -> list[tuple[str, int]]:
        chained = [(self._chars[node], node + 1)] if self._chained[node] else []
        return chained + list(self._branches.get(node, {}).items())

    def _link_failures(self, depth: list[int], whole: set[int]) -> None:
        """Failure links (the node of the longest proper suffix that is in the trie), breadth
        first so that a node's link, which is shallower, is known before the node's children."""
        fail, match, hold = [0] * len(depth), [0] * len(depth), [0] * len(depth)
        queue = deque(child for _, child in self._children(0))  # their links are the root
        while queue:
            node = queue.popleft()
            children = self._children(node)
            match[node] = depth[node] if node in whole else match[fail[node]]
            hold[node] = depth[node] if children else hold[fail[node]]
            for char, child in children:
                link = fail[node]
                while (found := self._child(link, char)) is None and link:
                    link = fail[link]
                fail[child] = found or 0
                queue.append(child)
        self._fail, self._match, self._hold = array("i", fail), array("i", match), array("i", hold)

    @property
    def partial_length(self) -> int:
        """How many trailing characters fed so far could still grow into a stop string."""
        return self._hold[self._node]

    def feed(self, text: str) -> int | None:
        """Consume the stream's next characters; return where (an index into the whole stream)
        the earliest-starting stop string that ends within them starts (its length in
        `stop_length`), or None.

        For a stream with no stop before `text`, that is `find_stop` on the whole stream.
        """
        node, position, steps, cut = self._node, self.num_fed_chars, 0, None
        for char in text:
            position += 1
            steps += 1
            while (child := self._child(node, char)) is None and node:
                node = self._fail[node]
                steps += 1
            node = child or 0
            length = self._match[node]
            if length and (cut is None or position - length < cut):
                cut, self.stop_length = position - length, length
        self._node, self.num_fed_chars = node, position
        self.num_steps += steps
        return cut
