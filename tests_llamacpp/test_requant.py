"""The Q4_1 -> Q8_0 rewrite keeps every other tensor and all metadata, and bounds its error."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, quants

from tokenflow import LLM
from tokenflow.core.request import SamplingParams
from tokenflow.integrations.llamacpp.requant import as_q8_0

Q4_1, Q8_0 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
# Q8_0 stores its scale s = max|w| / 127 in float16: half a step of rounding, plus up to 127
# steps times float16's relative error (2^-11) on the scale.
HALF_STEP_BOUND = 0.5 + 127 * 2.0**-11


def test_q4_1_tensors_become_q8_0_within_about_half_a_step(gguf, tmp_path):
    source = gguf.path
    target = as_q8_0(source, tmp_path)
    before, after = GGUFReader(str(source)), GGUFReader(str(target))
    assert {n: f.contents() for n, f in before.fields.items() if not n.startswith("GGUF.")} == {
        n: f.contents() for n, f in after.fields.items() if not n.startswith("GGUF.")
    }
    rewritten = {t.name: t for t in after.tensors}
    assert len(rewritten) == len(before.tensors)
    checked = 0
    for tensor in before.tensors:
        new = rewritten[tensor.name]
        assert list(new.shape) == list(tensor.shape)
        if tensor.tensor_type != Q4_1:
            assert new.tensor_type == tensor.tensor_type
            assert np.array_equal(new.data, tensor.data)
            continue
        assert new.tensor_type == Q8_0
        if checked < 3:  # a few whole tensors: every weight within HALF_STEP_BOUND x s
            old = quants.dequantize(tensor.data, Q4_1).reshape(-1, 32)
            err = np.abs(quants.dequantize(new.data, Q8_0).reshape(-1, 32) - old)
            bound = np.abs(old).max(axis=1, keepdims=True) / 127 * HALF_STEP_BOUND
            assert (err <= bound).all()
            checked += 1
    assert checked == 3
    mtime = target.stat().st_mtime_ns
    assert as_q8_0(source, tmp_path) == target  # cached: not written again
    assert target.stat().st_mtime_ns == mtime
    assert not list(tmp_path.glob("*.partial"))


def test_the_engine_runs_the_q8_0_weights():
    llm = LLM(executor="llama-cpp", weights="q8_0", device="cpu", num_threads=2)
    try:
        greedy = SamplingParams(max_tokens=6, temperature=0.0)
        [out] = llm.generate(["The capital of France is"], greedy)
        assert "Paris" in out.outputs[0].text
    finally:
        llm.engine.close()
