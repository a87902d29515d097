"""`tokenflow profile --out PROFILE.json`: time the real engine's steps and fit the simulator's
costs to them, for `tokenflow simulate --profile PROFILE.json`.

It takes the model and engine flags of `serve`, builds the same engine in this process, and:

1. serves a short burst through the engine's whole step (scheduler, forward pass, output
   processing, the stats the server reads): what a step costs beyond its forward pass;
2. sweeps step shapes through the engine's executor (`tokenflow.calibrate.sweep`): decodes
at
   several
   batches and contexts, prefill chunks of several sizes and depths, alone and beside decodes,
   and block copies in both directions;
3. counts the tokens the server makes of the bench client's prompts (the chat template's own);
4. fits `StepCosts` (tokenflow/calibrate/costs.py);
5. starts `tokenflow serve` and streams two bursts through it with the bench client, which
   prices the serving path per step (tokenflow/calibrate/probe.py; `--no-serve-probe` skips it);
6. writes everything, residuals and raw samples included (tokenflow/calibrate/profile_file.py).

About two minutes for the embedded model on a 2-core CPU.  A busy machine makes slow steps:
the CPU steal during the profile is recorded beside it, and a profile can be re-taken.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from tokenflow.calibrate.machine import cpu_facts, cpu_use, read_cpu_times
from tokenflow.calibrate.probe import (
    PROBE_POLICY,
    prefill_speed_factor,
    request_path_s,
    serving_costs,
    speed_factor,
)
from tokenflow.calibrate.sweep import StepSample, SweepSpec, run_sweep, sweep_device_blocks

if TYPE_CHECKING:  # torch-side types, imported when a profile is taken, not at start-up
    from tokenflow.calibrate.costs import Residuals, StepCosts
    from tokenflow.calibrate.profile_file import ProbePoint, Profile, PromptTokens
    from tokenflow.core.plan import StepPlan, StepResult
    from tokenflow.engine.engine_args import EngineArgs
    from tokenflow.engine.llm_engine import LLMEngine
    from tokenflow.model.tokenizer import Tokenizer

_BURST_REQUESTS = 16
_BURST_PROMPT_TOKENS = 48
_BURST_OUTPUT_TOKENS = 24
_PROMPT_WORDS = (16, 64, 128, 256)


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    """`serve`'s engine options, plus where to write and how long to sweep."""
    from tokenflow.cli.engine_options import add_engine_options

    add_engine_options(parser)
    out = parser.add_argument_group("profile")
    out.add_argument("--out", required=True, help="write the profile (JSON) to this file")
    out.add_argument("--rounds", type=int, default=2, help="passes over the sweep, alternated")
    out.add_argument("--repeats", type=int, default=3, help="timed steps per point and round")
    out.add_argument(
        "--no-serve-probe",
        action="store_true",
        help="skip the bursts through a real server that price the serving path (HTTP, "
        "delivery, the client); its cost is then the in-process engine's only",
    )
    out.add_argument("--no-progress", action="store_true")


def run_profile(args: argparse.Namespace) -> int:
    """`tokenflow profile` with parsed arguments; returns the exit code."""
    from tokenflow.calibrate.profile_file import ProfileError
    from tokenflow.cli.engine_options import engine_args_from
    from tokenflow.model.config import ModelLoadError

    try:
        served = engine_args_from(args)
        spec = SweepSpec(rounds=args.rounds, repeats=args.repeats)
        profile = take_profile(
            served, spec, progress=not args.no_progress, probe=not args.no_serve_probe
        )
        profile.save(args.out)
    except (ValueError, OSError, ModelLoadError, ProfileError) as err:
        print(f"tokenflow profile: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    _print_summary(profile, args.out)
    return 0


def take_profile(
    served: EngineArgs, spec: SweepSpec, progress: bool = True, probe: bool = True
) -> Profile:
    """Build the engine `served` describes (its device tier widened to the sweep's largest
    point), measure it, fit, and return the `Profile`."""
    from tokenflow.calibrate.costs import fit_step_costs, residuals
    from tokenflow.engine.llm_engine import LLMEngine
    from tokenflow.integrations.executors import executor_factory
    from tokenflow.sim.overhead import default_overhead

    started = read_cpu_times()
    begin_s = time.perf_counter()
    profiled = profiled_engine_args(served, spec)
    engine = LLMEngine(profiled, build_executor=executor_factory(profiled.executor))
    total = spec.num_steps + _BURST_REQUESTS + _BURST_OUTPUT_TOKENS + 8
    with tqdm(total=total, desc="profile", unit="step", disable=not progress) as bar:
        server_s, per_chunk_s = measure_server_overhead(engine, bar.update)
        kv = engine.scheduler.kv.config
        tiers = (kv.block_size, kv.num_device_blocks, kv.num_host_blocks)
        samples = run_sweep(engine.executor, time.perf_counter, spec, tiers, lambda: bar.update(1))
    points = serving_probe(engine, profiled) if probe else ()
    engine.close()
    threshold = served.serial_below_tokens if engine.device.type == "cpu" else 0
    fitted = replace(
        fit_step_costs(samples, threshold), server_step_s=server_s, server_per_chunk_s=per_chunk_s
    )
    extra_s, extra_per_stream_s = serving_costs(points) if points else (0.0, 0.0)
    probe_step_s = default_overhead(PROBE_POLICY).step_s
    factor = speed_factor(fitted, points, probe_step_s)
    costs = replace(
        fitted,
        server_step_s=server_s + extra_s,
        server_per_chunk_s=per_chunk_s + extra_per_stream_s,
        speed_factor=factor,
        prefill_speed_factor=prefill_speed_factor(fitted, points, factor, probe_step_s),
        request_path_s=request_path_s(points),
    )
    use = cpu_use(started, read_cpu_times())
    machine = {
        **_machine_facts(engine),
        "profile_s": time.perf_counter() - begin_s,
        **(use.to_dict() if use else {}),
    }
    profile = _assemble(engine, served, machine, costs, residuals(costs, samples), samples)
    return replace(profile, probe=tuple(points))


def profiled_engine_args(served: EngineArgs, spec: SweepSpec) -> EngineArgs:
    """The engine a profile measures: `served`, its tiers widened to the sweep's largest point,
    and no prefix cache.  The profile times prefills; the probe sends the same prompts again
    and again, and a cached prefix would make every repeat after the first look almost free
    (its prefill factor came out 0.17-0.32).  The simulator charges a cache itself."""
    block_size = served.block_size
    need = sweep_device_blocks(spec, block_size) * block_size
    widened = replace(served, enable_prefix_caching=False)
    if served.device_kv_fraction is None:
        widened = replace(widened, device_kv_tokens=max(served.device_kv_tokens, need))
    return replace(widened, host_kv_tokens=max(served.host_kv_tokens, 128 * block_size))


def serving_probe(engine: LLMEngine, served: EngineArgs) -> list[ProbePoint]:
    """Bursts through a real server and through `engine`, alternated (calibrate/probe.py)."""
    from tokenflow.calibrate.probe import probe_serving_path

    print("probing the serving path through tokenflow serve ...", file=sys.stderr)
    chat = prompt_tokens(engine.tokenizer)["chat"]
    return probe_serving_path(engine_flags(served), engine, chat.tokens)


def engine_flags(served: EngineArgs) -> list[str]:
    """`serve` flags that rebuild the profiled engine's executor (tiers and policy aside)."""
    from dataclasses import fields

    from tokenflow.engine.engine_args import EngineArgs

    flags: list[str] = []
    for name in ("model", "device", "dtype", "weights", "executor", "num_threads",
                 "serial_below_tokens", "block_size"):  # fmt: skip
        value = getattr(served, name)
        default = next(f.default for f in fields(EngineArgs) if f.name == name)
        if value != default:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    if served.compile_decode:
        flags.append("--compile-decode")
    if served.llama_cpp_repack:
        flags.append("--llama-cpp-repack")
    if not served.kernel_cache:
        flags.append("--no-kernel-cache")
    if not served.enable_prefix_caching:
        flags.append("--no-enable-prefix-caching")
    return flags


def measure_server_overhead(
    engine: LLMEngine, on_step: Callable[[int], object]
) -> tuple[float, float]:
    """A short burst through the engine's whole step: (fixed, per chunk) seconds a step costs
    beyond its forward pass and the scheduler charge the simulator adds on its own."""
    from tokenflow.calibrate.costs import nonnegative_lstsq
    from tokenflow.core.consumption import DEFAULT_READER_RATE_TPS
    from tokenflow.core.request import SamplingParams
    from tokenflow.sim.overhead import default_overhead

    timed = _TimedExecutor(engine.core.executor)
    engine.core.executor = timed
    params = SamplingParams(
        max_tokens=_BURST_OUTPUT_TOKENS, min_tokens=_BURST_OUTPUT_TOKENS, ignore_eos=True
    )
    for i in range(_BURST_REQUESTS):
        prompt = [1000 + (7 * i + j) % 5000 for j in range(_BURST_PROMPT_TOKENS)]
        engine.add_request(f"profile-{i}", prompt, params, rate_tps=DEFAULT_READER_RATE_TPS)
    rows, targets = [], []
    while engine.has_work:
        timed.last_plan, timed.last_s = None, 0.0
        begin = time.perf_counter()
        engine.step()
        engine.stats()  # the server reads a snapshot after every step
        outside_s = time.perf_counter() - begin - timed.last_s
        plan = timed.last_plan
        if plan is not None and plan.chunks:
            rows.append([1.0, float(len(plan.chunks))])
            targets.append(outside_s)
        on_step(1)
    engine.core.executor = timed.inner
    import numpy as np

    fixed_s, per_chunk_s = nonnegative_lstsq(np.array(rows), np.array(targets))
    charge = default_overhead(engine.args.policy)
    return max(fixed_s - charge.fixed_s, 0.0), max(per_chunk_s - charge.per_request_s, 0.0)


class _TimedExecutor:
    """The engine's executor, with the duration of its latest `execute()` kept."""

    def __init__(self, inner: Any) -> None:  # the engine's executor (any of its kinds)
        self.inner = inner
        self.last_s = 0.0
        self.last_plan: StepPlan | None = None

    def execute(self, plan: StepPlan) -> StepResult:
        self.last_plan = plan
        begin = time.perf_counter()
        try:
            return self.inner.execute(plan)
        finally:
            self.last_s = time.perf_counter() - begin


def prompt_tokens(tokenizer: Tokenizer) -> dict[str, PromptTokens]:
    """Tokens the server makes of bench prompts, fitted as fixed + per word, per endpoint."""
    from tokenflow.calibrate.profile_file import PromptTokens
    from tokenflow.eval.client import synthetic_prompt

    def fit(count: Callable[[str], int]) -> PromptTokens:
        points = [(n, count(synthetic_prompt(n, i))) for n in _PROMPT_WORDS for i in range(3)]
        mean_n = sum(n for n, _ in points) / len(points)
        mean_t = sum(t for _, t in points) / len(points)
        slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / sum(
            (n - mean_n) ** 2 for n, _ in points
        )
        return PromptTokens(fixed_tokens=mean_t - slope * mean_n, per_word=slope)

    chat = fit(lambda text: len(tokenizer.apply_chat_template([{"role": "user", "content": text}])))
    return {"chat": chat, "completions": fit(lambda text: len(tokenizer.encode(text)))}


def _machine_facts(engine: LLMEngine) -> dict[str, Any]:
    import torch

    return {
        **cpu_facts(),
        "device": str(engine.device),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def _model_facts(engine: LLMEngine) -> dict[str, Any]:
    from tokenflow.model.loader import default_model_path

    config = engine.model_config
    executor = engine.executor
    dtype = getattr(getattr(executor, "kv_cache", None), "dtype", None)
    return {
        "name": engine.model_name,
        "path": engine.args.model or default_model_path(),
        "architecture": config.architecture,
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "executor": engine.args.executor,
        "weights": engine.args.weights,
        "kernels": engine.kernels,
        "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
    }


def _assemble(
    engine: LLMEngine,
    served: EngineArgs,
    machine: dict[str, Any],
    costs: StepCosts,
    fit_residuals: Sequence[Residuals],
    samples: Sequence[StepSample],
) -> Profile:
    from tokenflow.calibrate.profile_file import EngineFacts, Profile
    from tokenflow.core.step_budget import MIN_PREFILL_CHUNK_TOKENS  # the engine's floor
    from tokenflow.engine.build import context_length

    kv = engine.scheduler.kv.config
    facts = EngineFacts(
        block_size=kv.block_size,
        block_bytes=kv.block_bytes,
        device_kv_tokens=served.device_kv_tokens,
        host_kv_tokens=served.host_kv_tokens,
        max_num_seqs=served.max_num_seqs,
        max_prefill_tokens=served.max_prefill_tokens,
        step_target_ms=served.step_target_ms,
        min_prefill_chunk_tokens=MIN_PREFILL_CHUNK_TOKENS,
        max_model_len_cap=context_length(
            served.max_model_len, engine.model_config.max_position_embeddings, 1 << 30
        ),
        default_rate_tps=served.default_rate_tps,
    )
    return Profile(
        machine=machine,
        model=_model_facts(engine),
        engine=facts,
        scheduler=engine.scheduler.config,
        tokenflow=served.tokenflow_for(engine.device.type),
        prompt=prompt_tokens(engine.tokenizer),
        costs=costs,
        residuals=tuple(fit_residuals),
        samples=tuple(samples),
    )


def _print_summary(profile: Profile, path: str) -> None:
    costs = profile.costs
    took_s = profile.machine["profile_s"]
    print(f"wrote {path}: {len(profile.samples)} timed steps in {took_s:.0f} s")
    if profile.model.get("kernels"):
        print(f"  {profile.model['kernels']}")
    for name in ("serial", "parallel"):
        fit = asdict(getattr(costs, name))
        print(f"  {name:8s} " + ", ".join(f"{k} {v * 1e3:.4g} ms" for k, v in fit.items()))
    for name in ("d2h", "h2d"):
        fit = getattr(costs, name)
        print(f"  {name:8s} latency {fit.latency_s * 1e3:.3g} ms, {fit.block_s * 1e6:.3g} us/block")
    print(
        f"  server   {costs.server_step_s * 1e3:.3g} ms/step + "
        f"{costs.server_per_chunk_s * 1e6:.3g} us/chunk beyond the forward pass"
    )
    print(
        f"  speed    the sweep's fit x {costs.speed_factor:.3f}, its prefill terms "
        f"x {costs.prefill_speed_factor:.3f} (the probe's in-process steps)"
    )
    print(f"  request  {costs.request_path_s * 1e3:.3g} ms to first token beyond the steps")
    for p in profile.probe:
        print(
            f"  probe    batch {p.batch:2d}: a step every {p.step_gap_s * 1e3:.1f} ms through "
            f"the server, {p.in_process_step_s * 1e3:.1f} ms in-process"
        )
    for r in profile.residuals:
        print(
            f"  residuals {r.kind:8s} n={r.num_samples:4d} median {r.median_abs:.1%} "
            f"rms {r.rms:.1%} max {r.max_abs:.1%}"
        )
    steal = profile.machine.get("steal_fraction")
    if steal is not None:
        print(f"  CPU steal during the profile: {steal:.1%}")
