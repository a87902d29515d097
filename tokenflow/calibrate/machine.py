"""Facts about the machine a measurement ran on: the CPU, and how much of it others took.

CPU steal (`/proc/stat`, the 8th field of the `cpu` line) is time the hypervisor gave this
virtual machine's CPUs to someone else: on a shared VM it swings a run's throughput by tens of
percent, so every real measurement records the share of CPU time stolen while it ran.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

# The CPU flags that decide which kernels the engine's CPU backends can use.
_FLAGS_OF_INTEREST = (
    "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8",
)  # fmt: skip


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative jiffies of all CPUs since boot (`/proc/stat`)."""

    total: int
    idle: int  # idle + iowait
    steal: int


def read_cpu_times(path: str = "/proc/stat") -> CpuTimes | None:
    """The `cpu` line of /proc/stat, or None where there is none (not Linux)."""
    try:
        with open(path, encoding="ascii") as file:
            first = file.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal guest guest_nice; guests are in user
    values = [int(v) for v in first[1:9]] + [0] * max(0, 9 - len(first))
    return CpuTimes(total=sum(values[:8]), idle=values[3] + values[4], steal=values[7])


@dataclass(frozen=True)
class CpuUse:
    """What happened to the CPUs between two readings, as shares of all CPU time."""

    steal_fraction: float
    busy_fraction: float  # neither idle nor stolen (this run and everyone else on the VM)

    def to_dict(self) -> dict[str, float]:
        return {"steal_fraction": self.steal_fraction, "busy_fraction": self.busy_fraction}


def cpu_use(before: CpuTimes | None, after: CpuTimes | None) -> CpuUse | None:
    """Steal and busy shares between two readings (None if either is missing or no time
    passed)."""
    if before is None or after is None or after.total <= before.total:
        return None
    total = after.total - before.total
    steal = after.steal - before.steal
    idle = after.idle - before.idle
    return CpuUse(steal_fraction=steal / total, busy_fraction=(total - idle - steal) / total)


def cpu_facts(cpuinfo_path: str = "/proc/cpuinfo") -> dict[str, object]:
    """CPU model, logical CPUs and the flags of interest, for a profile's `machine`."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as file:
            for line in file:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    return {
        "cpu_model": model,
        "num_cpus": os.cpu_count() or 1,
        "cpu_flags": [f for f in _FLAGS_OF_INTEREST if f in flags],
        "python": platform.python_version(),
        "system": f"{platform.system()} {platform.release()}",
    }
