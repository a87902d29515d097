"""`tokenflow bench`: replay a workload against one or more OpenAI-compatible servers, report.

The main CLI mounts it with `add_bench_arguments(subparser)` and `run_bench(args)`.  Several
servers (e.g. one per scheduling policy) are benchmarked one after the other with the same
workload by `bench_targets()`, and reported side by side.

Exit codes: 0 when every run completed at least one request, 1 when a run completed none,
2 for bad arguments or an unwritable output (a one-line message on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TextIO

from tokenflow.cli.workload import add_workload_arguments, workload_from_args
from tokenflow.eval.client import ENDPOINTS, BenchRun, ClientConfig, run_workload
from tokenflow.eval.metrics import MetricsConfig, Summary, summarize
from tokenflow.eval.report import class_summaries, format_table, goodput_note, write_json
from tokenflow.eval.workload import WorkloadRequest, save_trace


@dataclass(frozen=True)
class BenchTarget:
    """One server to benchmark and the name its row gets in the report."""

    name: str
    url: str


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The `tokenflow bench` options (workload, target server, outputs)."""
    server = parser.add_argument_group("server")
    server.add_argument("--url", default=None, help="server base URL, e.g. http://127.0.0.1:8000")
    server.add_argument(
        "--compare",
        default=None,
        help="instead of --url: start our server once per policy (e.g. fcfs,tokenflow)",
    )
    server.add_argument(
        "--serve-args", default="", help="extra `tokenflow serve` options for --compare"
    )
    server.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="chat")
    server.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    server.add_argument("--api-key", default=None)
    server.add_argument("--name", default="server", help="this run's name in the report")
    add_workload_arguments(parser, default_kind="burst")
    out = parser.add_argument_group("run and output")
    out.add_argument("--timeout", type=float, default=3600.0, help="whole-run limit (s)")
    out.add_argument("--max-concurrency", type=int, default=None, help="in-flight request cap")
    out.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="goodput's SLOs as vLLM's bench spells them: ttft:MS and/or tpot:MS (default "
        "ttft:2000 tpot:200); a request is good when it meets every one",
    )
    out.add_argument("--json", default=None, help="write the summaries to this JSON file")
    out.add_argument("--plot", default=None, help="write plots to this PNG file")
    out.add_argument(
        "--save-trace",
        default=None,
        metavar="FILE",
        help="write the workload as a JSONL trace (`--workload trace --trace FILE` replays it, "
        "here or in `tokenflow simulate`)",
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def client_config_from_args(args: argparse.Namespace) -> ClientConfig:
    """Raises ValueError with a one-line message for bad values."""
    return ClientConfig(
        url=args.url,
        endpoint=args.endpoint,
        model=args.model,
        max_concurrency=args.max_concurrency,
        timeout_s=args.timeout,
        api_key=args.api_key,
        show_progress=not args.no_progress,
    )


async def benchmark(
    targets: Sequence[BenchTarget], requests: Sequence[WorkloadRequest], config: ClientConfig
) -> dict[str, BenchRun]:
    """Run the same workload against each target in turn (config.url is replaced per target)."""
    names = [target.name for target in targets]
    if len(set(names)) != len(names):
        raise ValueError(f"run names must be unique, got {names}")
    runs: dict[str, BenchRun] = {}
    for target in targets:
        target_config = replace(config, url=target.url)
        runs[target.name] = await run_workload(requests, target_config, name=target.name)
    return runs


def goodput_config(items: Sequence[str] | None) -> MetricsConfig:
    """`--goodput ttft:MS tpot:MS` (vLLM's bench spelling, milliseconds) as the metrics'
    SLOs; ValueError naming a bad item."""
    config = MetricsConfig()
    for item in items or ():
        key, _, value = item.partition(":")
        field_name = {"ttft": "slo_ttft_s", "tpot": "slo_tpot_s"}.get(key)
        try:
            milliseconds = float(value)
        except ValueError:
            milliseconds = math.nan
        if field_name is None or not milliseconds > 0:
            raise ValueError(f"--goodput takes ttft:MS and tpot:MS (MS > 0), got {item!r}")
        config = replace(config, **{field_name: milliseconds / 1000})
    return config


def report_runs(
    runs: Mapping[str, BenchRun],
    *,
    json_path: str | None = None,
    plot_path: str | None = None,
    metrics_config: MetricsConfig | None = None,
    out: TextIO | None = None,
    title: str = "",
) -> dict[str, Summary]:
    """Print the table (and failures to stderr); write the JSON and PNG if asked.  Preemptions
    are the server's own count when its /metrics has one (`BenchRun.num_preemptions`)."""
    config = metrics_config if metrics_config is not None else MetricsConfig()
    out = out if out is not None else sys.stdout
    summaries = {name: _summary(run, config) for name, run in runs.items()}
    print(format_table(summaries), file=out)
    by_class = class_summaries({name: run.traces for name, run in runs.items()}, config)
    if by_class:
        print(format_table(by_class), file=out)
    print(goodput_note(config), file=out)
    for name, run in runs.items():
        print(f"{name}: {_counts_text(run.server_counts)}", file=out)
    _report_failures(runs)
    if json_path is not None:
        write_json(json_path, summaries)
        print(f"wrote {json_path}", file=sys.stderr)
    if plot_path is not None:
        from tokenflow.eval.plots import plot_report

        traces = {name: run.traces for name, run in runs.items()}
        plot_report(plot_path, summaries, traces, title=title)
        print(f"wrote {plot_path}", file=sys.stderr)
    return summaries


def _summary(run: BenchRun, config: MetricsConfig) -> Summary:
    return replace(summarize(run.traces, config), num_preemptions=run.num_preemptions)


def _counts_text(counts: Mapping[str, int]) -> str:
    """What the server counted, in words; or that it exports no counters."""
    if not counts:
        return "the server's /metrics has no preemption counters (preemptions: n/a)"
    words = {"preemptions": "preemptions", "kv_loads": "KV reloads", "recomputes": "recomputes"}
    counted = ", ".join(f"{counts[key]} {word}" for key, word in words.items() if key in counts)
    return f"the server counted {counted}"


def _report_failures(runs: Mapping[str, BenchRun]) -> None:
    for name, run in runs.items():
        if run.num_failed:
            print(f"{name}: {run.num_failed} of {len(run.traces)} requests failed", file=sys.stderr)
        if run.num_unsent:
            print(
                f"{name}: {run.num_unsent} conversation turns not sent (an earlier turn failed)",
                file=sys.stderr,
            )
        if run.num_failed or run.num_unsent:
            for line in run.errors[:5]:
                print(f"  {line}", file=sys.stderr)


def run_bench(args: argparse.Namespace) -> int:
    """`tokenflow bench` with parsed arguments; returns the exit code."""
    if (args.url is None) == (args.compare is None):
        return _fail("give exactly one of --url URL and --compare POLICY,POLICY")
    try:
        for path in (args.json, args.plot):
            if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
                raise ValueError(f"cannot write {path}: its directory does not exist")
        metrics_config = goodput_config(args.goodput)
        requests = workload_from_args(args)
        if args.save_trace is not None:
            save_trace(args.save_trace, requests)
        url = args.url or "http://127.0.0.1"  # --compare fills in each server's URL
        config = client_config_from_args(argparse.Namespace(**{**vars(args), "url": url}))
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    from tokenflow.eval.local_server import ServerStartError

    try:
        runs = _run(args, requests, config)
        model = next((run.model for run in runs.values() if run.model), "the server's")
        title = f"{len(requests)} requests ({args.workload}), model {model}"
        summaries = report_runs(
            runs,
            json_path=args.json,
            plot_path=args.plot,
            metrics_config=metrics_config,
            title=f"{title}: {' vs '.join(runs)}",
        )
    except (ServerStartError, ValueError, OSError) as exc:
        return _fail(str(exc))
    return 0 if all(s.num_completed > 0 for s in summaries.values()) else 1


def _run(
    args: argparse.Namespace, requests: Sequence[WorkloadRequest], config: ClientConfig
) -> dict[str, BenchRun]:
    """The workload against `--url`, or against one server per `--compare` policy."""
    if args.compare is None:
        return asyncio.run(benchmark([BenchTarget(args.name, args.url)], requests, config))
    from tokenflow.core.policies import parse_policy_names
    from tokenflow.eval.local_server import compare_policies

    policies = parse_policy_names(args.compare)
    return compare_policies(policies, shlex.split(args.serve_args), requests, config)


def _fail(message: str) -> int:
    print(f"tokenflow bench: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point: `python -m tokenflow.cli.bench --url ...`."""
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="tokenflow bench", description=__doc__.splitlines()[0]
    )
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
