"""A picture of /dashboard in the middle of a reading burst, for the README.

Starts `tokenflow serve` (the embedded SmolLM2, a device tier of 1,664 tokens so streams are
paused and resumed), plays a burst of readers against it with the bench client, waits until the
burst is well under way (some streams paused), and has Debian's headless Chromium load the page
and take a screenshot after `--page-s` seconds of the page's time.  That time is Chromium's
virtual time (the only wait its `--screenshot` honours): it stands still while a poll is in
flight and skips the idle second between polls, so the page's chart covers `--page-s` seconds
that took the server about as many polls' latency:

    .venv/bin/python -m tests_dashboard.screenshot [--out docs/results/dashboard.png]
        [--policy tokenflow] [--serve-args "--device-kv-tokens 1664"] [--page-s 60]
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from tokenflow.eval.client import ClientConfig, run_workload
from tokenflow.eval.local_server import local_server
from tokenflow.eval.workload import LengthDist, RateMix, WorkloadSpec, generate

BURST = WorkloadSpec(
    kind="burst",
    num_requests=16,
    prompt=LengthDist(128, 0),
    output=LengthDist(192, 0),
    rates=RateMix.parse("2:0.5,4:0.5"),
    seed=0,
)
WINDOW = "1400,900"
UNDER_WAY_TIMEOUT_S = 300.0  # a hang guard: the burst pauses its first streams in seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/results/dashboard.png"))
    parser.add_argument("--policy", default="tokenflow")
    parser.add_argument("--serve-args", default="--device-kv-tokens 1664")
    parser.add_argument("--page-s", type=float, default=60.0, help="the page's polling time")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    return parser.parse_args(argv)


def streams(url: str) -> dict:
    return httpx.get(f"{url}/v1/tokenflow/streams", timeout=30).json()


def wait_under_way(url: str) -> None:
    """Until some stream is paused (or, under FCFS, some wait while others run)."""
    deadline = time.monotonic() + UNDER_WAY_TIMEOUT_S
    while time.monotonic() < deadline:
        totals = streams(url)["totals"]
        if totals["num_paused"] or (totals["num_waiting"] and totals["num_running"]):
            return
        time.sleep(0.2)
    raise RuntimeError("the burst never paused or queued a stream")


def screenshot(chromium: str, url: str, out: Path, page_s: float) -> None:
    """Load the page and capture it after `page_s` seconds of its virtual time."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tokenflow-chromium-") as profile:
        command = [
            chromium,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--window-size={WINDOW}",
            f"--virtual-time-budget={int(page_s * 1000)}",
            f"--screenshot={out.resolve()}",
            f"{url}/dashboard",
        ]
        subprocess.run(command, check=True, capture_output=True, timeout=300)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with local_server(args.policy, shlex.split(args.serve_args)) as url:
        config = ClientConfig(url=url, endpoint="completions", show_progress=False)
        burst = threading.Thread(
            target=asyncio.run, args=(run_workload(generate(BURST), config),), daemon=True
        )
        burst.start()
        wait_under_way(url)
        screenshot(args.chromium, url, args.out, args.page_s)
        totals = streams(url)["totals"]
        print(f"wrote {args.out} ({totals['num_unfinished']} streams unfinished)", file=sys.stderr)
        # (the server stops here; the burst's streams end with it)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
