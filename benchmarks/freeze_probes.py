"""How long the reliability suite's freeze probes hold the server: for each hostile request
(tests_reliability/freeze.py), the worst /health latency (polled every 50 ms while it is out)
and the worst gap between the frames of an innocent greedy stream beside it.

    .venv/bin/python -m benchmarks.freeze_probes [--serve-args "..."]
    .venv/bin/python -m benchmarks.freeze_probes --url URL [--api-keys A,B [--key-limited]]

Started here, the server runs `--serve-args` (by default the suite's: dense float32 on one
thread, two API keys) plus `--max-requests-per-key 2`, so that every probe runs on it; it gets
this environment (e.g. ATEN_CPU_CAPABILITY=avx2).  At `--url`, the probes that need keys run
with `--api-keys`, and those of per-key limits only with `--key-limited` (the server runs
`--max-requests-per-key 2`).  Prints a markdown table, then whatever answered otherwise than
expected; exits 1 if anything did.  Targets: innocent gap < 2 s, /health < 0.5 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import shlex
from collections.abc import Sequence

from tests_reliability.freeze import (
    FREEZE_INNOCENT,
    KEY_LIMIT,
    FreezeProbe,
    ProbeRun,
    freeze_probes,
    problems,
    run_probe,
)
from tests_reliability.probe import SERVE_ARGS, FrameTimes, client, send, serve_args_keys
from tokenflow.eval.compare import free_port, running_server, serve_command

TARGET_GAP_S = 2.0
TARGET_HEALTH_S = 0.5


def runnable(probe: FreezeProbe, has_keys: bool, is_key_limited: bool) -> bool:
    """Whether the server under probe has what `probe` needs."""
    if probe.needs == "keys":
        return has_keys
    if probe.needs == "key limit":
        return has_keys and is_key_limited
    return True


async def innocent_alone(url: str, api_keys: Sequence[str]) -> tuple[str, float]:
    """The innocent stream's text alone, and its own worst gap between frames."""
    frames = FrameTimes()
    async with client(url, 4, api_keys[-1] if api_keys else None) as http:
        outcome = await send(http, FREEZE_INNOCENT, frames=frames)
    if not outcome.is_complete:
        raise SystemExit(f"the innocent stream does not complete alone: {outcome}")
    times = frames.times_s
    return outcome.text, max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def table(results: list[tuple[FreezeProbe, ProbeRun, bool]]) -> str:
    """One row per probe: its status, the worst /health, the innocent's worst gap, exactness."""
    lines = [
        "| probe | status | worst /health (s) | innocent worst gap (s) | innocent exact |",
        "|---|---|---|---|---|",
    ]
    for probe, run, is_exact in results:
        status = run.answer.status
        shown = f"{status}" + ("" if status == probe.status else f" (expected {probe.status})")
        lines.append(
            f"| {probe.name} | {shown} | {run.worst_health_s:.2f} | "
            f"{run.innocent_worst_gap_s:.2f} | {'yes' if is_exact else 'NO'} |"
        )
    return "\n".join(lines)


async def measure(url: str, api_keys: Sequence[str], is_key_limited: bool) -> int:
    """Run every probe the server allows; print the table and what went wrong (1 if any)."""
    solo_text, solo_gap_s = await innocent_alone(url, api_keys)
    results, found = [], []
    for probe in freeze_probes():
        if not runnable(probe, bool(api_keys), is_key_limited):
            print(f"skipped (needs {probe.needs}): {probe.name}")
            continue
        run = await run_probe(url, api_keys, probe)
        wrong = problems(probe, run, solo_text)
        is_exact = run.innocent.is_complete and run.innocent.text == solo_text
        results.append((probe, run, is_exact))
        found += [f"- {probe.name}: {problem}" for problem in [*wrong, *run.notes]]
    print(f"innocent alone: {len(solo_text)} characters, worst gap {solo_gap_s:.2f} s\n")
    print(table(results))
    worst_gap_s = max(run.innocent_worst_gap_s for _, run, _ in results)
    worst_health_s = max(run.worst_health_s for _, run, _ in results)
    print(
        f"\nworst innocent gap {worst_gap_s:.2f} s (target < {TARGET_GAP_S:g}), worst /health "
        f"{worst_health_s:.2f} s (target < {TARGET_HEALTH_S:g})"
    )
    if found:
        print("\n" + "\n".join(found))
    return 1 if found else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="probe this server instead of starting one")
    parser.add_argument("--serve-args", default=SERVE_ARGS, help="of the server started here")
    parser.add_argument("--api-keys", default="", help="KEY,KEY: the keys of the server at --url")
    parser.add_argument(
        "--key-limited",
        action="store_true",
        help=f"the server at --url runs --max-requests-per-key {KEY_LIMIT}",
    )
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.url is None:
            serve_args = [*shlex.split(args.serve_args), "--max-requests-per-key", str(KEY_LIMIT)]
            port = free_port()
            command = serve_command(port, serve_args)
            url = stack.enter_context(running_server(command, port, name="tokenflow")).url
            api_keys, is_key_limited = serve_args_keys(serve_args), True
        else:
            url, is_key_limited = args.url, args.key_limited
            api_keys = tuple(key for key in args.api_keys.split(",") if key)
        return asyncio.run(measure(url, api_keys, is_key_limited))


if __name__ == "__main__":
    raise SystemExit(main())
