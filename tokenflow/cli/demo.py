"""`make demo`: TokenFlow seen working in two minutes.

Starts `tokenflow serve` with a device KV tier too small for the burst (so streams must take
turns: pauses and resumes happen), prints the dashboard's URL, plays the README's burst of 16
readers against it, then prints the table with the server's own preemption count and stops the
server.  Open the dashboard while the burst plays.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from collections.abc import Sequence

from tokenflow.cli.bench import report_runs
from tokenflow.eval.client import ClientConfig, run_workload
from tokenflow.eval.local_server import ServerStartError, free_port, running_server, serve_command
from tokenflow.eval.workload import LengthDist, RateMix, WorkloadSpec, generate

# A KV tier of 1,664 tokens holds about 5 of the burst's 16 streams at full length (128 + 192
# tokens each): the rest wait or take turns, which is what the dashboard is for.
DEMO_SERVE_ARGS = ("--device-kv-tokens", "1664")
DEMO_BURST = WorkloadSpec(
    kind="burst",
    num_requests=16,
    prompt=LengthDist.parse("128:0", minimum=8),
    output=LengthDist.parse("192:0", minimum=8),
    rates=RateMix.parse("2:0.5,4:0.5"),
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="make demo", allow_abbrev=False, description=__doc__.splitlines()[0]
    )
    parser.add_argument("--port", type=int, default=None, help="default: a free port")
    parser.add_argument(
        "--serve-args", default="", help="more `tokenflow serve` options (e.g. '--policy fcfs')"
    )
    args = parser.parse_args(argv)
    port = args.port or free_port()
    command = serve_command(port, [*DEMO_SERVE_ARGS, *shlex.split(args.serve_args)])
    print(f"starting: {shlex.join(command[2:])} (loading the model takes up to a minute)")
    try:
        with running_server(command, port, name="tokenflow-demo") as server:
            print(f"dashboard: {server.url}/dashboard  (open it now: the burst starts)")
            requests = generate(DEMO_BURST)
            config = ClientConfig(url=server.url, endpoint="chat")
            run = asyncio.run(run_workload(requests, config, name="burst"))
            report_runs({"tokenflow": run})
    except ServerStartError as error:
        print(f"make demo: {error}", file=sys.stderr)
        return 1
    print("the server stopped; `make serve` runs one that stays")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
