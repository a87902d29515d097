"""The paper's experimental setups (paper §7, Table 1) as simulator presets.

Lengths are normal with std = 25% of the mean (the paper states only means), clipped to
[16, 2 x mean].  S/L: RTX 4090 inputs 512 / 1024, outputs 1024 / 2048; the H200 doubles the
outputs.  Readers are mixed: 40% at 15 tok/s, 60% at 20 tok/s.  Memory: the RTX 4090 uses 90% of
its memory for weights + KV pool (SGLang's default on a 24 GB card), the H200 only 30% (as the
paper runs it, to create memory pressure).  Poisson setups send one minute of arrivals.  Host
memory for the KV host tier: 64 GiB beside an RTX 4090 (a workstation), 512 GiB beside an H200
(a server; the paper does not state it).

Chat setups (beyond the paper; kind "conversation", tokenflow/eval/conversation.py) turn prefix
caching on: `h200-chat` on the H200 deployment above, and `cpu-chat`, sized for the profiled
CPU engine (`tokenflow simulate --profile PROFILE.json --setup cpu-chat`, as the CPU workloads
of tokenflow/sim/suite.py run).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenflow.eval.conversation import ConversationSpec
from tokenflow.eval.workload import LengthDist, RateMix, WorkloadSpec

PAPER_RATES = "15:0.4,20:0.6"


@dataclass(frozen=True)
class Setup:
    name: str
    gpu: str
    model: str
    memory_fraction: float
    host_memory_gib: float
    workload: WorkloadSpec
    description: str
    prefix_caching: bool = False


@dataclass(frozen=True)
class ProfiledSetup:
    """A workload for a profiled real engine (`simulate --profile`): the deployment is the
    profile's, with this device KV tier."""

    name: str
    workload: WorkloadSpec
    device_kv_tokens: int
    description: str
    prefix_caching: bool = False


def _lengths(mean: int) -> LengthDist:
    return LengthDist(mean=mean, std=mean / 4, minimum=16, maximum=2 * mean)


def _spec(kind: str, n: int, rate: float, prompt: int, output: int, seed: int) -> WorkloadSpec:
    return WorkloadSpec(
        kind=kind,
        num_requests=n,
        request_rate=rate,
        prompt=_lengths(prompt),
        output=_lengths(output),
        rates=RateMix.parse(PAPER_RATES),
        seed=seed,
    )


def paper_setups(seed: int = 0) -> dict[str, Setup]:
    """All eight presets: 4090-a..d and h200-a..d."""
    setups: dict[str, Setup] = {}
    for gpu, fraction, host_gib, scale, bursts, rates in (
        ("4090", 0.9, 64.0, 1, (60, 80), (2.0, 4.0)),
        ("h200", 0.3, 512.0, 2, (400, 200), (5.0, 10.0)),
    ):
        s_in, l_in, l_out = 512, 1024, 2048 * scale
        rows = {
            "a": ("burst", bursts[0], 0.0, s_in, f"burst of {bursts[0]}, SL"),
            "b": ("burst", bursts[1], 0.0, l_in, f"burst of {bursts[1]}, LL"),
            "c": ("poisson", int(60 * rates[0]), rates[0], s_in, f"Poisson {rates[0]:g} req/s, SL"),
            "d": ("poisson", int(60 * rates[1]), rates[1], s_in, f"Poisson {rates[1]:g} req/s, SL"),
        }
        for letter, (kind, n, rate, prompt, text) in rows.items():
            name = f"{gpu}-{letter}"
            workload = _spec(kind, n, rate or 1.0, prompt, l_out, seed)
            gpu_name = "rtx4090" if gpu == "4090" else "h200"
            setups[name] = Setup(name, gpu_name, "llama3-8b", fraction, host_gib, workload, text)
    return setups


def chat_setup(seed: int = 0) -> Setup:
    """h200-chat: Llama3-8B on an H200 at the paper's memory split, serving 100 chat sessions
    over 4 apps with ~2,000-token system prompts, 3-8 turns of 100-300-token messages, the
    paper's H200 outputs and readers, 20 s mean think times, and Poisson session arrivals at
    0.05/s, where FCFS queues (P99 TTFT about a minute).  A session lasts ~25 simulated minutes
    (its answers take ~4 minutes to read), so 100 sessions already simulate about an hour."""
    workload = WorkloadSpec(
        kind="conversation",
        request_rate=0.05,  # sessions/s
        output=_lengths(4096),
        rates=RateMix.parse(PAPER_RATES),
        seed=seed,
        conversation=ConversationSpec(
            num_sessions=100,
            min_turns=3,
            max_turns=8,
            num_apps=4,
            system_prompt=LengthDist(2000, 250, minimum=1500, maximum=2500),
            user_message=LengthDist(200, 50, minimum=100, maximum=300),
            think_mean_s=20.0,
        ),
    )
    text = "100 chat sessions, Poisson 0.05/s, 4 apps, 3-8 turns, prefix caching"
    return Setup(
        name="h200-chat",
        gpu="h200",
        model="llama3-8b",
        memory_fraction=0.3,
        host_memory_gib=512.0,
        workload=workload,
        description=text,
        prefix_caching=True,
    )


def cpu_chat_setup(seed: int = 0) -> ProfiledSetup:
    """cpu-chat: the chat workload at the scale of the profiled CPU workloads (prompts of a few
    hundred tokens, answers of ~100, readers at 2-4 tok/s, a device KV tier of 2,048 tokens:
    tokenflow/sim/suite.py), where FCFS queues a little (P99 TTFT ~5 s on the 2-core VM's
    profile)."""
    workload = WorkloadSpec(
        kind="conversation",
        request_rate=0.5,  # sessions/s
        output=LengthDist.parse("96:24", minimum=8),
        rates=RateMix.parse("2:0.5,4:0.5"),
        seed=seed,
        conversation=ConversationSpec(
            num_sessions=16,
            min_turns=2,
            max_turns=4,
            num_apps=2,
            system_prompt=LengthDist.parse("384", minimum=8),
            user_message=LengthDist.parse("48:12", minimum=8),
            think_mean_s=8.0,
        ),
    )
    text = "16 chat sessions, Poisson 0.5/s, 2 apps, 2-4 turns, device KV 2048 tokens"
    return ProfiledSetup(
        name="cpu-chat",
        workload=workload,
        device_kv_tokens=2048,
        description=text,
        prefix_caching=True,
    )


def get_setup(name: str, seed: int = 0) -> Setup:
    """A GPU preset by name; ValueError lists the valid names."""
    setups = paper_setups(seed) | {"h200-chat": chat_setup(seed)}
    if name == "cpu-chat":
        raise ValueError("setup cpu-chat runs on a profiled engine: add --profile PROFILE.json")
    if name not in setups:
        raise ValueError(f"unknown setup {name!r}; choose one of {', '.join(setup_names())}")
    return setups[name]


def get_profiled_setup(name: str, seed: int = 0) -> ProfiledSetup:
    """A preset for a profiled engine by name; ValueError if it is a GPU one or unknown."""
    if name != "cpu-chat":
        raise ValueError(
            f"--setup {name} describes a GPU roofline: its options do not apply with --profile "
            "(a profiled engine takes --setup cpu-chat)"
        )
    return cpu_chat_setup(seed)


def setup_names() -> list[str]:
    """Every preset's name: the GPU ones, then those for a profiled engine."""
    return [*paper_setups(), "h200-chat", "cpu-chat"]
