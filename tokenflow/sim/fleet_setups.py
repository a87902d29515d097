"""The fleet presets (`tokenflow simulate --setup fleet-...`): the GPUs of their replicas, the
workload, and the replicas that join or restart during the run."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tokenflow.eval.conversation import ConversationSpec
from tokenflow.eval.workload import LengthDist, RateMix, WorkloadSpec
from tokenflow.sim.fleet import ReplicaJoined, ReplicaLeft
from tokenflow.sim.runner import SimConfig
from tokenflow.sim.setups import PAPER_RATES


@dataclass(frozen=True)
class FleetSetup:
    """A fleet preset: the GPUs of its replicas, the workload, and the replicas that join
    (copies of the first GPU) or are restarted (replica I leaves at `restarts_at_s[I]`, and a
    fresh replica of its GPU joins at that moment) during the run."""

    name: str
    gpus: tuple[str, ...]
    workload: WorkloadSpec
    description: str
    joins_at_s: tuple[float, ...] = ()
    restarts_at_s: tuple[float, ...] = ()
    prefix_caching: bool = False  # every replica's (conversation workloads turn it on)


_MEMORY = {"h200": (0.3, 512.0), "rtx4090": (0.9, 64.0)}  # as the paper setups (setups.py)


def fleet_setups(seed: int = 0) -> dict[str, FleetSetup]:
    """fleet-h200-burst, fleet-h200-poisson-40, fleet-h200-poisson-80, fleet-mixed-burst: the
    H200 workload of the paper (inputs 512, outputs 2048, readers at 15/20 tok/s) at 8x;
    fleet-h200-scaleout (a burst onto 4 H200s, 4 more joining at 60 s) and fleet-h200-rolling
    (8 H200s under Poisson load, restarted one at a time): replicas joining and leaving;
    fleet-h200-chat and fleet-h200-chat-burst: conversations, prefix caching on (`_chat_setup`,
    `_chat_burst_setup`)."""

    def spec(kind: str, n: int, rate: float) -> WorkloadSpec:
        lengths = {m: LengthDist(mean=m, std=m / 4, minimum=16, maximum=2 * m) for m in (512, 2048)}
        rates = RateMix.parse(PAPER_RATES)
        return WorkloadSpec(
            kind, n, rate, prompt=lengths[512], output=lengths[2048], rates=rates, seed=seed
        )

    h200s = ("h200",) * 8
    mixed = ("h200",) * 4 + ("rtx4090",) * 4
    presets = (
        FleetSetup("fleet-h200-burst", h200s, spec("burst", 3200, 1.0), "8 x H200, burst of 3,200"),
        FleetSetup(
            "fleet-h200-poisson-40", h200s, spec("poisson", 2400, 40.0), "8 x H200, 40 req/s"
        ),
        FleetSetup(
            "fleet-h200-poisson-80", h200s, spec("poisson", 4800, 80.0), "8 x H200, 80 req/s"
        ),
        FleetSetup(
            "fleet-mixed-burst", mixed, spec("burst", 1840, 1.0), "4 x H200 + 4 x RTX 4090, 1,840"
        ),
        FleetSetup(
            "fleet-h200-scaleout",
            ("h200",) * 4,
            spec("burst", _SCALEOUT_BURST, 1.0),
            f"4 x H200, burst of {_SCALEOUT_BURST:,}, 4 more H200 joining at 60 s",
            joins_at_s=(60.0,) * 4,
        ),
        FleetSetup(
            "fleet-h200-rolling",
            h200s,
            spec("poisson", _ROLLING_REQUESTS, _ROLLING_RATE),
            f"8 x H200, {_ROLLING_RATE:g} req/s, restarted one at a time from 10 s, "
            f"{_ROLLING_GAP_S:g} s apart",
            restarts_at_s=tuple(10.0 + _ROLLING_GAP_S * i for i in range(8)),
        ),
        _chat_setup(seed),
        _chat_burst_setup(seed),
    )
    return {p.name: p for p in presets}


def _chat_setup(seed: int) -> FleetSetup:
    """fleet-h200-chat: sessions arriving as a Poisson stream (16/s for a minute) of 4-8 turns
    whose messages paste text (~1,000 tokens: a document, code, a log) and whose answers are
    ~256 tokens (`_chat_workload`): the histories (up to ~12,000 tokens) outweigh the system
    prompt, and the fleet is loaded but keeps them cached.  (At 20/s every router's P99 TTFT
    is ~15 s and the histories are evicted: the routers tie.)"""
    chat = ConversationSpec(
        num_sessions=_CHAT_SESSIONS_PER_S * 60,
        min_turns=4,
        max_turns=8,
        user_message=LengthDist(1000, 250, minimum=500, maximum=1500),
        think_mean_s=10.0,
        session_arrivals="poisson",
        **_CHAT_APPS,
    )
    output = LengthDist(256, 64, minimum=16, maximum=512)
    return FleetSetup(
        "fleet-h200-chat",
        ("h200",) * 8,
        _chat_workload(chat, output, _CHAT_SESSIONS_PER_S, seed),
        f"8 x H200, {_CHAT_SESSIONS_PER_S} chat sessions/s for a minute, 4 apps, 4-8 turns "
        "of pasted text, prefix caching",
        prefix_caching=True,
    )


def _chat_burst_setup(seed: int) -> FleetSetup:
    """fleet-h200-chat-burst: a burst of 1,200 sessions of 2-6 turns of 100-300-token messages
    and ~512-token answers (`_chat_workload`): the tail is the burst's first turns, which the
    fleet's prefill rate bounds whatever the routing.  (A Poisson stream of these sessions at
    40/s kept every router under 0.2 s P99 TTFT.)"""
    chat = ConversationSpec(
        num_sessions=_CHAT_BURST_SESSIONS,
        min_turns=2,
        max_turns=6,
        user_message=LengthDist(200, 50, minimum=100, maximum=300),
        think_mean_s=10.0,
        session_arrivals="burst",
        **_CHAT_APPS,
    )
    output = LengthDist(512, 128, minimum=16, maximum=1024)
    return FleetSetup(
        "fleet-h200-chat-burst",
        ("h200",) * 8,
        _chat_workload(chat, output, 1.0, seed),  # (the rate is unused: the sessions burst)
        f"8 x H200, a burst of {_CHAT_BURST_SESSIONS:,} chat sessions, 4 apps, 2-6 turns, "
        "prefix caching",
        prefix_caching=True,
    )


def _chat_workload(
    chat: ConversationSpec, output: LengthDist, sessions_per_s: float, seed: int
) -> WorkloadSpec:
    """The chat presets' workload: 8 x H200 (Llama3-8B at the paper's memory split), prefix
    caching on, serving `chat`'s sessions over 4 apps whose ~2,000-token system prompts every
    session of the app repeats (`_CHAT_APPS`); answers of `output` read at the paper's rates,
    a 10 s mean think time before the reader replies.  Each turn resends the session's history,
    so a turn's replica decides both the prefill it repeats and its readers' slack."""
    return WorkloadSpec(
        kind="conversation",
        request_rate=sessions_per_s,
        output=output,
        rates=RateMix.parse(PAPER_RATES),
        seed=seed,
        conversation=chat,
    )


_SCALEOUT_BURST = 2400  # 600 per first replica: twice what one holds at once
_ROLLING_RATE = 40.0  # as fleet-h200-poisson-40: the fleet has room, a restart tests moving
_ROLLING_REQUESTS = 2400
_ROLLING_GAP_S = 6.0
_CHAT_SESSIONS_PER_S = 16  # 2 a replica; each turn a ~2,000-12,000-token prompt
# The chat presets' apps: 4, each its ~2,000-token system prompt
_CHAT_APPS = {"num_apps": 4, "system_prompt": LengthDist(2000, 250, minimum=1500, maximum=2500)}
_CHAT_BURST_SESSIONS = 1200  # 150 a replica; each turn a ~2,500-token prompt, a ~512 answer


def fleet_replicas(setup: FleetSetup, base: SimConfig) -> tuple[SimConfig, ...]:
    """One deployment per GPU of the preset: `base` with that GPU's memory split (and
    prefix caching, if the preset turns it on)."""
    return tuple(_on_gpu(_cached(base, setup), gpu) for gpu in setup.gpus)


def fleet_changes(setup: FleetSetup, base: SimConfig) -> tuple[ReplicaJoined | ReplicaLeft, ...]:
    """The preset's replicas joining and leaving, each new one `base` on its GPU."""
    base = _cached(base, setup)
    joins = [ReplicaJoined(at_s, _on_gpu(base, setup.gpus[0])) for at_s in setup.joins_at_s]
    restarts: list[ReplicaJoined | ReplicaLeft] = []
    for index, at_s in enumerate(setup.restarts_at_s):
        restarts.append(ReplicaLeft(at_s, f"replica-{index}"))
        restarts.append(ReplicaJoined(at_s, _on_gpu(base, setup.gpus[index])))
    return (*joins, *restarts)


def _cached(base: SimConfig, setup: FleetSetup) -> SimConfig:
    return replace(base, prefix_caching=True) if setup.prefix_caching else base


def _on_gpu(base: SimConfig, gpu: str) -> SimConfig:
    fraction, host_gib = _MEMORY[gpu]
    return replace(base, gpu=gpu, memory_fraction=fraction, host_memory_gib=host_gib)


def get_fleet_setup(name: str, seed: int = 0) -> FleetSetup:
    """A fleet preset by name; ValueError lists the valid names."""
    setups = fleet_setups(seed)
    if name not in setups:
        raise ValueError(f"unknown fleet setup {name!r}; choose one of {', '.join(setups)}")
    return setups[name]
