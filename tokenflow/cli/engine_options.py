"""The real engine's options (`EngineArgs`) on a command line, for `serve` and `profile`, and
the `EngineArgs` a parsed command line builds.

Imports no torch: `tokenflow serve --help` builds its parser from here.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import fields, replace
from pathlib import Path

from tokenflow.cli.policy_options import add_policy_arguments, has_policy_options, policy_config
from tokenflow.core.config import tokenflow_defaults
from tokenflow.core.consumption import DEFAULT_READER_RATE_TPS
from tokenflow.core.policies import POLICY_NAMES
from tokenflow.core.prefix_cache import RETENTIONS
from tokenflow.engine.engine_args import EXECUTORS, EngineArgs, resolve_device

# `org/name`: how a model hub names a model (what `vllm serve` downloads).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_INT_OPTIONS = (
    "block_size",
    "device_kv_tokens",
    "host_kv_tokens",
    "max_model_len",
    "max_num_seqs",
    "max_prefill_tokens",
    "chunk_tokens",
    "max_num_requests",
    "seed",
)


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Options for every `EngineArgs` field, and the policy's."""
    group = parser.add_argument_group("engine")
    _add_model_options(group)
    _add_size_options(group)
    _add_step_options(group)
    _add_cache_options(group)
    add_default_rate_argument(group)
    add_policy_arguments(parser.add_argument_group("tokenflow policy"), _device_defaults)


def add_default_rate_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """`--default-rate` (into `default_rate_tps`): the one flag that sets a server's rate of
    readers that state none, for the engine's options and for whatever reads them (the fleet's
    router)."""
    parser.add_argument(
        "--default-rate",
        type=float,
        default=DEFAULT_READER_RATE_TPS,
        dest="default_rate_tps",
        help="tokens/s of a reader that states no rate (see --default-class)",
    )


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """Build from parsed options (ValueError on bad values, a model hub's id, or a chat
    template file that cannot be read).  The policy is the device's defaults with the knobs
    given; left None when none is given."""
    check_model_source(args.model)
    names = {f.name for f in fields(EngineArgs)} - {"tokenflow", "chat_template"}
    built = EngineArgs(
        **{n: getattr(args, n) for n in names},
        chat_template=read_chat_template(args.chat_template),
    )
    if not has_policy_options(args):
        return built
    base = tokenflow_defaults(resolve_device(built.device).type)
    return replace(built, tokenflow=policy_config(args, base))


def check_model_source(model: str | None) -> None:
    """ValueError when `model` is no local path but a model hub's id (`org/name`), before
    anything loads: TokenFlow serves local files only."""
    if model is None or Path(model).exists() or not _HUB_ID.fullmatch(model):
        return
    if model.endswith(".gguf"):
        return  # a missing file: the loader names it
    raise ValueError(
        f"model {model!r} is not a local path, and TokenFlow does not download from model "
        "hubs: pass a local GGUF file or HF safetensors directory, e.g. after "
        f"`huggingface-cli download {model} --local-dir DIR`, pass DIR"
    )


def read_chat_template(value: str | None) -> str | None:
    """A `--chat-template` value as template text: the file it names if one exists (vLLM's
    rule), else the value itself when it looks like Jinja; ValueError for a missing file."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"cannot read the chat template {value}: {err}") from None
    if not any(c in value for c in "{}\n"):
        raise ValueError(f"chat template file {value} does not exist (nor is it a template)")
    return value


def _add_model_options(group: argparse._ArgumentGroup) -> None:
    """The model, where it runs, its weights, the policy and the chat template."""
    group.add_argument("--model", default=None, help="GGUF file or HF safetensors dir")
    group.add_argument("--device", default="auto")
    group.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    group.add_argument(
        "--weights",
        default="auto",
        choices=["auto", "int4", "dense", "q8_0"],
        help="auto: on CPU without --dtype, the kernels this machine runs fastest (measured "
        "once, then cached); int4: a GGUF's 4-bit weights packed (bf16 activations); dense: "
        "dequantize to --dtype; q8_0 (llama-cpp executor): Q4_1 rewritten as Q8_0",
    )
    group.add_argument(
        "--no-kernel-cache",
        action="store_false",
        dest="kernel_cache",
        help="measure the kernels again instead of reusing this machine's stored choice",
    )
    group.add_argument("--policy", default="tokenflow", choices=POLICY_NAMES)
    group.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_STRING",
        help="a Jinja chat template replacing the model's: a file's path, or the template "
        "itself (vLLM's flag)",
    )


def _add_size_options(group: argparse._ArgumentGroup) -> None:
    """The KV tiers and the limits: integer sizes, and the device tier as a memory share."""
    defaults = EngineArgs()
    for name in _INT_OPTIONS:
        option = f"--{name.replace('_', '-')}"
        group.add_argument(option, type=int, default=getattr(defaults, name))
    group.add_argument("--device-kv-fraction", type=float, default=None)


def _add_step_options(group: argparse._ArgumentGroup) -> None:
    """How steps run: chunk sizing, threads, compiling, the executor."""
    group.add_argument(
        "--step-target-ms",
        type=float,
        default=EngineArgs.step_target_ms,
        help="prefill chunks are sized so one step takes about this long",
    )
    group.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch CPU threads (default: all cores; 1 on a machine busy with other work)",
    )
    group.add_argument(
        "--serial-below-tokens",
        type=int,
        default=EngineArgs.serial_below_tokens,
        help="torch executor: CPU steps of fewer tokens (a few streams) run on one thread; "
        "waking idle OpenMP workers costs more than they add there (0: all threads always)",
    )
    group.add_argument(
        "--compile-decode",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run decode-only steps through compiled graphs (off by default; about 30 s more at "
        "the first start with an empty compiler cache, a few seconds later)",
    )
    group.add_argument(
        "--executor",
        default=EngineArgs.executor,
        choices=EXECUTORS,
        help="torch: our PyTorch model; llama-cpp: the GGUF through llama.cpp (needs the "
        "llamacpp extra; fastest at 1-8 streams on CPU, docs/results.md)",
    )
    group.add_argument(
        "--llama-cpp-repack",
        action="store_true",
        help="llama-cpp executor: let ggml repack weights into its CPU-specific layouts (AMX; "
        "AVX2/AVX-512 for Q4_0, Q4_K, IQ4_NL).  Off by default: it crashed on a CPU reporting "
        "AMX, and on x86 without AMX it leaves the shipped Q4_1 model's weights as they are",
    )


def _add_cache_options(group: argparse._ArgumentGroup) -> None:
    """The prefix cache and the structured outputs' grammar compiles."""
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=EngineArgs.enable_prefix_caching,
        help="reuse the KV of a prompt's leading full blocks that an earlier request computed "
        "(a shared system prompt, a conversation's history); usage.prompt_tokens_details."
        "cached_tokens says how many (vLLM's flag pair)",
    )
    group.add_argument(
        "--prefix-retention",
        choices=RETENTIONS,
        default=EngineArgs.prefix_retention,
        help="which cached blocks no request holds are reused first, on both KV tiers: "
        "'reading' by when their readers are expected back (after reading the answer and a "
        "think time), 'lru' least recently released (vLLM's rule)",
    )
    group.add_argument(
        "--grammar-compile-timeout-s",
        type=float,
        default=EngineArgs.grammar_compile_timeout_s,
        help="a structured output whose grammar takes longer to compile is refused (400); "
        "its compile process is killed",
    )
    group.add_argument(
        "--grammar-compile-workers",
        type=int,
        default=EngineArgs.grammar_compile_workers,
        help="processes that compile structured outputs' grammars (off the server and engine)",
    )


def _device_defaults(field: str) -> str:
    on_cpu = getattr(tokenflow_defaults("cpu"), field)
    on_gpu = getattr(tokenflow_defaults("cuda"), field)
    return f"{on_cpu:g}" if on_cpu == on_gpu else f"{on_cpu:g} on a CPU, {on_gpu:g} on a GPU"
