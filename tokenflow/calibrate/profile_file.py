"""PROFILE.json: what `tokenflow profile` measured of a real engine, and what the simulator needs
to replay a deployment of it (`tokenflow simulate --profile`).

One JSON object:

- `machine`, `model`: facts for the reader (CPU model and flags, threads, versions; the model's
  shape, weights and dtype);
- `engine`: the served deployment (tiers, limits, step target, the one-thread threshold);
- `scheduler`, `tokenflow`: the `SchedulerConfig` the engine built (its measured link rate and
  step-time priors included) and the `TokenFlowConfig` `serve` runs, field by field;
- `prompt`: how many tokens the server makes of the bench client's prompts of n words
  (fixed + per_word x n), per endpoint: the chat template adds its own;
- `costs`: the fitted `StepCosts`; `residuals`: the fit's relative residuals by kind of step;
- `samples`: every timed step of the sweep, so the fit can be redone;
- `probe`: the bursts through a real server that priced the serving path per step and per
  request.

Loading refuses unknown or missing keys with the key's path in the message.
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from tokenflow.calibrate.costs import ComputeFit, CopyFit, Residuals, StepCosts
from tokenflow.calibrate.sweep import StepSample
from tokenflow.core.config import SchedulerConfig, TokenFlowConfig

PROFILE_VERSION = 1


class ProfileError(ValueError):
    """A profile file that cannot be read; the message is one line naming the file."""


@dataclass(frozen=True)
class PromptTokens:
    """Tokens the server makes of a bench prompt of n words: round(fixed + per_word * n)."""

    fixed_tokens: float
    per_word: float

    def tokens(self, num_words: int) -> int:
        return max(1, round(self.fixed_tokens + self.per_word * num_words))


@dataclass(frozen=True)
class EngineFacts:
    """The served deployment the profile was taken for (`serve`'s flags as given)."""

    block_size: int
    block_bytes: int  # one KV block, all layers, K and V
    device_kv_tokens: int
    host_kv_tokens: int
    max_num_seqs: int
    max_prefill_tokens: int
    step_target_ms: float
    min_prefill_chunk_tokens: int  # the engine's floor under a step-target chunk
    max_model_len_cap: int  # what the model and --max-model-len allow (the tier aside)
    default_rate_tps: float


@dataclass(frozen=True)
class ProbePoint:
    """A burst of `batch` unread streams through a real server and through the profiled engine
    in-process (tokenflow/calibrate/probe.py): the median gap between a stream's tokens there,
    the median decode step here (the difference is the serving path's cost at that batch),
    and the median time to first token in each (0: not measured)."""

    batch: int
    step_gap_s: float
    in_process_step_s: float
    ttft_s: float = 0.0
    in_process_ttft_s: float = 0.0
    prompt_tokens: int = 0  # each stream's prompt as the engine saw it


@dataclass(frozen=True)
class Profile:
    """Everything in PROFILE.json (see the module docstring)."""

    machine: dict[str, Any]
    model: dict[str, Any]
    engine: EngineFacts
    scheduler: SchedulerConfig
    tokenflow: TokenFlowConfig
    prompt: dict[str, PromptTokens]  # by endpoint: "chat", "completions"
    costs: StepCosts
    residuals: tuple[Residuals, ...]
    samples: tuple[StepSample, ...]
    probe: tuple[ProbePoint, ...] = ()  # empty: measured in-process only (--no-serve-probe)
    version: int = PROFILE_VERSION

    def to_dict(self) -> dict[str, Any]:
        record = asdict(self)
        record["prompt"] = {k: asdict(v) for k, v in self.prompt.items()}
        return record

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as file:
            json.dump(self.to_dict(), file, indent=1)
            file.write("\n")


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read PROFILE.json; ProfileError (one line) for anything unreadable or malformed."""
    try:
        with open(path, encoding="utf-8") as file:
            record = json.load(file)
    except OSError as error:
        raise ProfileError(f"{path}: cannot read profile: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise ProfileError(f"{path}: invalid JSON ({error.msg} at line {error.lineno})") from None
    try:
        return profile_from_dict(record)
    except (TypeError, ValueError, KeyError) as error:
        raise ProfileError(f"{path}: {error}") from None


def profile_from_dict(record: Any) -> Profile:
    """A `Profile` from its JSON object (ValueError naming the bad key)."""
    _check_keys(record, Profile, "profile")
    version = record.get("version")
    if version != PROFILE_VERSION:
        raise ValueError(f"version {version!r}; this tokenflow reads version {PROFILE_VERSION}")
    costs = record["costs"]
    _check_keys(costs, StepCosts, "costs")
    step_costs = StepCosts(
        **{
            **costs,
            **{k: _build(ComputeFit, costs[k], f"costs.{k}") for k in ("serial", "parallel")},
            **{k: _build(CopyFit, costs[k], f"costs.{k}") for k in ("d2h", "h2d")},
        }
    )
    return Profile(
        machine=dict(record["machine"]),
        model=dict(record["model"]),
        engine=_build(EngineFacts, record["engine"], "engine"),
        scheduler=_build(SchedulerConfig, record["scheduler"], "scheduler"),
        tokenflow=_build(TokenFlowConfig, record["tokenflow"], "tokenflow"),
        prompt={k: _build(PromptTokens, v, f"prompt.{k}") for k, v in record["prompt"].items()},
        costs=step_costs,
        residuals=tuple(_build(Residuals, r, "residuals[]") for r in record["residuals"]),
        samples=tuple(_build(StepSample, s, "samples[]") for s in record["samples"]),
        probe=tuple(_build(ProbePoint, p, "probe[]") for p in record.get("probe", ())),
        version=version,
    )


def _check_keys(record: Any, cls: type, where: str) -> None:
    if not isinstance(record, dict):
        raise ValueError(f"{where} must be an object, got {type(record).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(record) - names)
    missing = sorted(names - set(record) - _optional(cls))
    if unknown or missing:
        raise ValueError(f"{where}: unknown keys {unknown}, missing keys {missing}")


def _optional(cls: type) -> set[str]:
    return {
        f.name for f in fields(cls) if f.default is not MISSING or f.default_factory is not MISSING
    }


def _build(cls: type, record: Any, where: str) -> Any:
    _check_keys(record, cls, where)
    return cls(**record)


def pool_profiles(profiles: list[Profile]) -> Profile:
    """Profiles of one engine taken at different times as one: their sweeps' samples fitted
    together (the per-point medians then run over every round), the serving path's cost the
    median of theirs, the facts the first one's."""
    import statistics

    from tokenflow.calibrate.costs import fit_step_costs, residuals

    if not profiles:
        raise ValueError("no profiles to pool")
    first = profiles[0]
    samples = tuple(s for p in profiles for s in p.samples)
    costs = fit_step_costs(samples, first.costs.serial_below_tokens)
    serving = [(p.costs.server_step_s, p.costs.server_per_chunk_s) for p in profiles]
    costs = StepCosts(
        **{
            **costs.__dict__,
            "server_step_s": statistics.median(s for s, _ in serving),
            "server_per_chunk_s": statistics.median(c for _, c in serving),
            "speed_factor": statistics.median(p.costs.speed_factor for p in profiles),
            "prefill_speed_factor": statistics.median(
                p.costs.prefill_speed_factor for p in profiles
            ),
            "request_path_s": statistics.median(p.costs.request_path_s for p in profiles),
        }
    )
    machine = {**first.machine, "pooled_profiles": len(profiles)}
    return Profile(
        machine=machine,
        model=first.model,
        engine=first.engine,
        scheduler=first.scheduler,
        tokenflow=first.tokenflow,
        prompt=first.prompt,
        costs=costs,
        residuals=tuple(residuals(costs, samples)),
        samples=samples,
        probe=tuple(pt for p in profiles for pt in p.probe),
    )
