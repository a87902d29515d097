"""The paper's experimental setups (paper §7, Table 1) as simulator presets.

Lengths are normal with std = 25% of the mean (the paper states only means), clipped to
[16, 2 x mean].  S/L: RTX 4090 inputs 512 / 1024, outputs 1024 / 2048; the H200 doubles the
outputs.  Readers are mixed: 40% at 15 tok/s, 60% at 20 tok/s.  Memory: the RTX 4090 uses 90% of
its memory for weights + KV pool (SGLang's default on a 24 GB card), the H200 only 30% (as the
paper runs it, to create memory pressure).  Poisson setups send one minute of arrivals.  Host
memory for the KV host tier: 64 GiB beside an RTX 4090 (a workstation), 512 GiB beside an H200
(a server; the paper does not state it).
"""

from __future__ import annotations

from dataclasses import dataclass

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


def get_setup(name: str, seed: int = 0) -> Setup:
    """A preset by name; ValueError lists the valid names."""
    setups = paper_setups(seed)
    if name not in setups:
        raise ValueError(f"unknown setup {name!r}; choose one of {', '.join(setups)}")
    return setups[name]
