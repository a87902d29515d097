"""Grammar compiles away from the server and the engine (tokenflow/model/grammar_compile.py) and
the bounds checked before them (tokenflow/model/schema_limits.py)."""

from __future__ import annotations

import json
import threading
from multiprocessing.connection import Connection

import pytest
import xgrammar

from tokenflow.core.request import StructuredOutput
from tokenflow.model.grammar import Grammars
from tokenflow.model.grammar_compile import (
    CompilerBusy,
    CompileWorker,
    GrammarCompiler,
    GrammarError,
    ProcessWorker,
    compiler_message,
)
from tokenflow.model.schema_limits import (
    MAX_ENUM_VALUES,
    MAX_PROPERTIES_PER_OBJECT,
    SchemaTooComplex,
    check_schema,
    nested_repeat,
)


def spec(schema: object) -> StructuredOutput:
    return StructuredOutput(json.dumps(schema), origin="response_format")


# -- bounds ---------------------------------------------------------------------------------------
def test_the_reported_pattern_is_refused_naming_the_bound():
    schema = {"type": "string", "pattern": "^([a-z0-9]{1,20}){1,20}$"}
    with pytest.raises(SchemaTooComplex, match="multiply to 400; at most 64"):
        check_schema(json.dumps(schema), "response_format")


@pytest.mark.parametrize(
    ("pattern", "product"),
    [
        ("^([a-z0-9]{1,20}){1,20}$", 400),
        ("[a-z]{1,1000}", 1),  # one level unrolls cheaply
        ("(a{8})[b]{2}", 1),
        ("(a{8}){8}", 64),
        ("((ab){4}c){4}", 16),
        ("a{2}{3}", 6),
        (r"\{3,4\}", 1),  # escaped braces are literals
        ("[{]{5}", 1),
        ("(x+){9}", 1),  # a loop is not an unrolling
    ],
)
def test_nested_repetition_is_the_product_of_the_counts(pattern, product):
    assert nested_repeat(pattern) == product


def test_many_properties_and_enum_values_are_refused():
    wide = {"type": "object", "properties": {f"p{i}": {} for i in range(2000)}}
    with pytest.raises(SchemaTooComplex, match=f"at most {MAX_PROPERTIES_PER_OBJECT}"):
        check_schema(json.dumps(wide), "guided_json")
    enum = {"enum": list(range(MAX_ENUM_VALUES + 1))}
    with pytest.raises(SchemaTooComplex, match="enum values"):
        check_schema(json.dumps(enum), "guided_json")


def test_a_bound_deep_inside_is_found_with_its_path():
    inner = {"type": "string", "pattern": "(a{9}){9}"}
    schema = {"type": "object", "properties": {"outer": {"anyOf": [{"type": "null"}, inner]}}}
    with pytest.raises(SchemaTooComplex, match=r"properties\.outer\.anyOf\[1\]\.pattern"):
        check_schema(json.dumps(schema), "x")


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "not": {"const": "a"}},
        {"type": "object", "if": {}, "then": {}},
        {"type": "array", "uniqueItems": True},
        {"type": "array", "contains": {"const": 5}},
        {"type": "number", "multipleOf": 0.5},
        {"type": "object", "dependentRequired": {"a": ["b"]}},
    ],
)
def test_keywords_the_compiler_would_ignore_are_refused_by_name(schema):
    keyword = next(k for k in schema if k != "type")
    with pytest.raises(SchemaTooComplex, match=f"keyword '{keyword}'"):
        check_schema(json.dumps(schema), "x")


def test_a_property_named_like_a_keyword_is_no_keyword():
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "if": {}}}
    check_schema(json.dumps(schema), "x")  # no error


def test_supported_schemas_pass():
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,30}$"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 5},
            "count": {"type": "integer", "multipleOf": 2},
        },
        "required": ["name"],
    }
    check_schema(json.dumps(schema), "x")


def test_the_compilers_message_loses_its_source_location_and_is_cut():
    err = RuntimeError(
        "[12:00:00] /src/json_schema.cc:42: Check failed: (x) is false: " + "y" * 500
    )
    message = compiler_message(err)
    assert ".cc" not in message and "Check failed" not in message
    assert message.startswith("yyy") and len(message) <= 203


# -- the compiler ---------------------------------------------------------------------------------
class BlockingWorker(CompileWorker):
    """Compiles in this process, once `release` is set (tests only)."""

    def __init__(self, info_json: str, release: threading.Event, started: threading.Event):
        self.info = xgrammar.TokenizerInfo.deserialize_json(info_json)
        self.release, self.started = release, started

    def compile(
        self, schema_text: str, timeout_s: float, origin: str, kind: str = "json_schema"
    ) -> str:
        self.started.set()
        assert self.release.wait(60), "the test never released the compile"
        compiler = xgrammar.GrammarCompiler(self.info, cache_enabled=False)
        return compiler.compile_json_schema(schema_text).serialize_json()

    def close(self) -> None:
        self.release.set()


@pytest.fixture(scope="module")
def tokenizer_info(tiny_grammars: Grammars) -> xgrammar.TokenizerInfo:
    return tiny_grammars.compiler.tokenizer_info


@pytest.fixture(scope="module")
def tiny_grammars(tiny_model_dir) -> Grammars:
    from tokenflow.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_directory(tiny_model_dir)
    grammars = Grammars(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id or 0])
    yield grammars
    grammars.close()


def test_equal_schemas_compile_once(tokenizer_info):
    release, started = threading.Event(), threading.Event()
    release.set()
    workers: list[BlockingWorker] = []

    def make(info_json: str) -> BlockingWorker:
        workers.append(BlockingWorker(info_json, release, started))
        return workers[-1]

    compiler = GrammarCompiler(tokenizer_info, make_worker=make)
    calls = []
    original = workers[0].compile
    workers[0].compile = lambda *a: calls.append(a) or original(*a)  # type: ignore[method-assign]
    first = compiler.compile(spec({"type": "integer"}))
    second = compiler.compile(spec({"type": "integer"}))
    assert first is second and len(calls) == 1


def test_a_caller_finding_every_worker_busy_gets_compiler_busy(tokenizer_info):
    release, started = threading.Event(), threading.Event()
    compiler = GrammarCompiler(
        tokenizer_info,
        timeout_s=0.2,
        make_worker=lambda info: BlockingWorker(info, release, started),
    )
    holder = threading.Thread(target=compiler.compile, args=(spec({"type": "integer"}),))
    holder.start()
    assert started.wait(60)  # the one worker is busy
    with pytest.raises(CompilerBusy, match="busy"):
        compiler.compile(spec({"type": "string"}))
    release.set()
    holder.join()


def never_answers(conn: Connection, tokenizer_info_json: str) -> None:
    """A compile process stuck in a compile that never ends."""
    conn.recv()
    threading.Event().wait()


def test_a_compile_past_its_deadline_has_its_process_killed():
    worker = ProcessWorker("{}", serve=never_answers)
    with pytest.raises(GrammarError, match="did not compile within 0.5 s"):
        worker.compile('{"type": "integer"}', 0.5, "response_format")
    assert worker.pid is None  # killed; the next compile starts a fresh process
    worker.close()


def test_the_process_worker_compiles_and_names_a_refusal(tokenizer_info):
    worker = ProcessWorker(tokenizer_info.serialize_json())
    try:
        grammar_json = worker.compile('{"type": "integer"}', 120, "x")
        grammar = xgrammar.CompiledGrammar.deserialize_json(grammar_json, tokenizer_info)
        assert grammar.memory_size_bytes > 0
        with pytest.raises(GrammarError, match="bogus"):
            worker.compile('{"type": "bogus"}', 120, "x")
    finally:
        worker.close()


def _accepts(grammar: xgrammar.CompiledGrammar, text: str) -> bool:
    """Whether `text`, then the end of the output, is what the grammar allows."""
    matcher = xgrammar.GrammarMatcher(grammar)
    return matcher.accept_string(text) and matcher.accept_token(matcher.stop_token_ids[0])


@pytest.mark.parametrize(
    ("kind", "text", "allowed", "refused"),
    [
        ("regex", r"(yes|no)\d", "no7", "maybe"),
        ("grammar", 'root ::= "a" | "b" "c"', "bc", "b"),
        ("grammar", 'root ::= "x\\"y" | "z"', 'x"y', "x"),  # a choice with a quote
    ],
)
def test_a_regex_and_a_grammar_compile_in_the_worker(tiny_grammars, kind, text, allowed, refused):
    grammar = tiny_grammars.compile(StructuredOutput(text, origin="guided_x", kind=kind))
    assert _accepts(grammar, allowed)
    assert not _accepts(grammar, refused)


def test_a_regex_or_grammar_over_the_bounds_is_refused_before_it_compiles():
    compiler = GrammarCompiler(xgrammar.TokenizerInfo(["a"]), make_worker=lambda info: _Never())
    nested = StructuredOutput("([a-z]{1,20}){1,20}", origin="guided_regex", kind="regex")
    with pytest.raises(SchemaTooComplex, match="guided_regex: the pattern's nested"):
        compiler.compile(nested)
    long = StructuredOutput("root ::= " + '"a" | ' * 20000 + '"b"', "guided_grammar", "grammar")
    with pytest.raises(SchemaTooComplex, match="guided_grammar: the grammar has"):
        compiler.compile(long)


def test_the_process_worker_names_a_grammar_it_refuses(tokenizer_info):
    worker = ProcessWorker(tokenizer_info.serialize_json())
    try:
        with pytest.raises(GrammarError, match="guided_grammar: the grammar cannot be compiled"):
            worker.compile("root ::= ", 120, "guided_grammar", "grammar")
    finally:
        worker.close()


class _Never:
    def compile(self, *args: object) -> str:
        raise AssertionError("a constraint over the bounds reached a worker")

    def close(self) -> None:
        pass
