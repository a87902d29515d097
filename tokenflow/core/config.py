"""Configuration of the scheduler and its policies: one frozen, validated dataclass per concern.

Field comments double as CLI help; defaults are documented with their reason.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from types import MappingProxyType


def _check_positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise ValueError(f"{type(obj).__name__}.{name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits shared by every policy (SGLang-like defaults)."""

    max_num_seqs: int = 256  # most requests resident on the device at once
    max_prefill_tokens: int = 16384  # prefill tokens in one step (one longer prompt runs alone)
    chunk_tokens: int = 2048  # token budget of a step under chunked prefill
    max_model_len: int = 1 << 20  # prompt + output tokens of one request
    init_new_token_ratio: float = 0.7  # admission reserves this share of each running
    min_new_token_ratio: float = 0.1  # request's remaining max_tokens; it decays to the minimum
    new_token_ratio_decay_steps: int = 600  # over this many steps, and resets on an OOM retraction
    link_bytes_per_s: float = 25e9  # host <-> device copy bandwidth, each direction
    initial_decode_step_s: float = 0.02  # step-time guesses until measurements arrive
    initial_prefill_token_s: float = 2e-4
    # What each extra decoding stream adds to a step until measured (None: 10% of a batch-1
    # step).  Gamma at batches never run yet is extrapolated with it, so a deployment that knows
    # its hardware (the simulator's cost model) should give it.
    initial_decode_seq_s: float | None = None
    initial_decode_token_s: float = 0.0  # what each context token adds (attention), until measured

    def decayed_new_token_ratio(self, ratio: float, init_ratio: float) -> float:
        """The admission reserve's ratio one step later: down from `init_ratio` to the minimum
        in `new_token_ratio_decay_steps` even steps (SGLang's schedule)."""
        step = (init_ratio - self.min_new_token_ratio) / self.new_token_ratio_decay_steps
        return max(self.min_new_token_ratio, ratio - step)

    def __post_init__(self) -> None:
        priors = ("initial_decode_seq_s", "initial_decode_token_s")
        _check_positive(self, *(f.name for f in fields(self) if f.name not in priors))
        if not (math.isfinite(self.initial_decode_token_s) and self.initial_decode_token_s >= 0):
            raise ValueError("initial_decode_token_s must be finite and >= 0")
        seq_s = self.initial_decode_seq_s
        if seq_s is not None and not (0 <= seq_s < self.initial_decode_step_s):
            raise ValueError("initial_decode_seq_s must be in [0, initial_decode_step_s)")
        if self.min_new_token_ratio > self.init_new_token_ratio:
            raise ValueError("min_new_token_ratio must not exceed init_new_token_ratio")


@dataclass(frozen=True)
class TokenFlowConfig:
    """Parameters of the buffer-aware policy (paper §4)."""

    schedule_interval_s: float = 0.5  # delta-t between scheduling decisions under stress
    # mu: pause j only if its buffer covers mu x (evict + load + one interval), plus the critical
    # slack (beyond the paper: a stream paused with less would be critical at once and thrash)
    buffer_conservativeness: float = 2.0
    working_set_smoothing: float = 0.2  # lambda: W_sched = W_static - lambda*(W_static - N_run)
    working_set_host_share: float = 4.0  # W_static counts device memory + this share of it on host
    critical_slack_s: float = 2.0  # T_critical: a buffer this close to dry means stress
    stall_penalty: float = 1.0  # gamma: weight of the empty-buffer term in a stream's priority
    value_horizon_s: float = 8.0  # a token's value falls to 0 when this much reading is buffered
    switch_penalty: float = 0.2  # utility lost by bringing a stream back to the device
    capacity_headroom: float = 1.0  # admit only while reading rates stay <= this share of Gamma
    # ... or while they stay <= this share when the whole queue fits in it: a small deficit is
    # spread as short stalls, not one long wait for the last requests (<= capacity_headroom: off;
    # docs/design.md has why it is off by default)
    queue_headroom: float = 1.0
    capacity_window_s: float = 1.0  # admission uses the lower median Gamma of this window
    max_stall_s: float = 1.0  # a stream stalled this long goes on the device before all others
    # A newcomer starts only while its prefill adds at most this stall to every resident reader
    # (`pricing.prefill_added_stall_s`): a prefill step stalls each reader with a shorter buffer;
    # unless the queued prefills outlast the residents' reading (`admission.stalls_residents`)
    prefill_stall_s: float = 0.1
    write_through: bool = True  # copy KV to the host continuously (ablation: False)
    # Admission's reserve for the residents' future tokens starts at this share of their
    # remaining output, or the scheduler's init_new_token_ratio if lower.  SGLang's 0.7 by
    # default; less on a CPU (`tokenflow_defaults`)
    init_new_token_ratio: float = 0.7

    def __post_init__(self) -> None:
        _check_positive(self, "schedule_interval_s", "buffer_conservativeness", "value_horizon_s")
        if not 0.0 <= self.init_new_token_ratio <= 1.0:
            raise ValueError("init_new_token_ratio must be in [0, 1]")
        if self.buffer_conservativeness < 1.0:
            raise ValueError("buffer_conservativeness (mu) must be >= 1")
        if not 0.0 <= self.working_set_smoothing <= 1.0:
            raise ValueError("working_set_smoothing (lambda) must be in [0, 1]")
        if self.critical_slack_s < 0 or self.stall_penalty < 0 or self.switch_penalty < 0:
            raise ValueError("critical_slack_s, stall_penalty and switch_penalty must be >= 0")
        if min(self.working_set_host_share, self.max_stall_s, self.capacity_window_s) < 0:
            raise ValueError(
                "working_set_host_share, max_stall_s and capacity_window_s must be >= 0"
            )
        if not self.prefill_stall_s >= 0:  # (inf: no limit)
            raise ValueError("prefill_stall_s must be >= 0")
        if not 0.0 < self.capacity_headroom <= 2.0:
            raise ValueError("capacity_headroom must be in (0, 2]")
        if not 0.0 < self.queue_headroom <= 2.0:
            raise ValueError("queue_headroom must be in (0, 2]")


def tokenflow_defaults(device_type: str) -> TokenFlowConfig:
    """The TokenFlow policy's defaults for an engine whose steps run on `device_type` ("cpu",
    or an accelerator: "cuda", and every simulated GPU), for every command that runs it.

    On a CPU steps are ~100x slower than on a GPU, so buffers grow by about one second of
    reading per second and newcomers wait for streams to become pausable: a pause margin
    (critical slack) of 1 s instead of 2, and an admission reserve of 0.3 of the residents'
    remaining output instead of SGLang's 0.7 (TokenFlow pauses a stream short of memory instead
    of retracting it), took the CPU reading burst's P99 TTFT from 13-17 s to 11-12 s.  In the
    GPU simulator the same values raised overload stalls, so accelerators keep 2 s and 0.7."""
    if device_type == "cpu":
        return TokenFlowConfig(critical_slack_s=1.0, init_new_token_ratio=0.3)
    return TokenFlowConfig()


@dataclass(frozen=True)
class PolicyKnob:
    """A TokenFlow knob as the commands' flags name it."""

    field: str  # the TokenFlowConfig field it sets
    help: str


# `--<name>` in serve, simulate and profile (tokenflow/cli/policy_options.py), and the keys of
# `tokenflow tune`'s config files.
POLICY_KNOBS: Mapping[str, PolicyKnob] = MappingProxyType(
    {
        "schedule_interval": PolicyKnob(
            "schedule_interval_s", "seconds between TokenFlow's decisions under stress"
        ),
        "mu": PolicyKnob(
            "buffer_conservativeness", "buffer conservativeness: a pause needs mu x a round trip"
        ),
        "critical_slack": PolicyKnob(
            "critical_slack_s", "seconds of buffer that mean stress, and a pause's margin"
        ),
        "new_token_ratio": PolicyKnob(
            "init_new_token_ratio",
            "admission reserves this share of each resident's remaining output at first",
        ),
        "capacity_headroom": PolicyKnob(
            "capacity_headroom", "admit while reading rates stay <= this share of capacity"
        ),
        "queue_headroom": PolicyKnob(
            "queue_headroom",
            "admit the whole queue while its reading rates stay <= this share of capacity "
            "(e.g. 1.15: shorter P99 TTFT, longer stalls)",
        ),
        "max_stall_s": PolicyKnob(
            "max_stall_s", "a stream stalled this long goes on the device first"
        ),
        "prefill_stall_s": PolicyKnob(
            "prefill_stall_s",
            "a newcomer starts while its prefill stalls no resident reader longer",
        ),
    }
)


def with_knobs(base: TokenFlowConfig, knobs: Mapping[str, float | None]) -> TokenFlowConfig:
    """`base` with the knobs given by their flag names (None: not given)."""
    given = {POLICY_KNOBS[name].field: v for name, v in knobs.items() if v is not None}
    return replace(base, **given)


@dataclass(frozen=True)
class AndesConfig:
    """Parameters of the Andes QoE-aware policy (arXiv 2404.16283)."""

    kv_usage_threshold: float = 0.9  # act only above this device KV use (or when waiting grows)
    horizon_s: float = 1.0  # QoE is predicted this far ahead
    ttft_target_s: float = 1.0  # ideal first token at arrival + target
    max_preemptions_per_request: float = 1.0  # P: anti-thrashing budget, on average
    num_batch_candidates: int = 6  # batch sizes tried between the smallest and largest
    decision_interval_s: float = 0.1  # re-plan at most this often (bounds the knapsack's cost)

    def __post_init__(self) -> None:
        _check_positive(
            self, "horizon_s", "ttft_target_s", "num_batch_candidates", "decision_interval_s"
        )
        if not 0.0 < self.kv_usage_threshold <= 1.0:
            raise ValueError("kv_usage_threshold must be in (0, 1]")
        if self.max_preemptions_per_request < 0:
            raise ValueError("max_preemptions_per_request must be >= 0")
