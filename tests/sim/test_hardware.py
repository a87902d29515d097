import dataclasses

import pytest

from tokenflow.sim.hardware import ModelSpec, get_gpu, get_model, gpu_specs, model_specs


def test_llama3_8b_parameter_count() -> None:
    assert get_model("llama3-8b").num_params == pytest.approx(8.03e9, rel=0.01)


def test_qwen25_32b_parameter_count() -> None:
    assert get_model("Qwen2.5-32B").num_params == pytest.approx(32.76e9, rel=0.01)


def test_qwen2_7b_parameter_count() -> None:
    assert get_model("qwen2-7b").num_params == pytest.approx(7.62e9, rel=0.01)


def test_llama3_8b_kv_bytes_per_token() -> None:
    # 2 (K, V) * 32 layers * 8 KV heads * 128 head_dim * 2 bytes
    assert get_model("llama3-8b").kv_bytes_per_token == 131072


def test_weight_bytes_is_params_times_dtype() -> None:
    model = get_model("llama3-8b")
    assert model.weight_bytes == 2 * model.num_params


def test_tied_embeddings_drop_the_lm_head() -> None:
    untied = get_model("qwen2-7b")
    tied = dataclasses.replace(untied, tie_word_embeddings=True)
    assert untied.num_params - tied.num_params == untied.vocab_size * untied.hidden_size


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("h200", "H200"),
        ("H100", "H100 SXM"),
        ("a100", "A100 80GB SXM"),
        ("A6000", "RTX A6000"),
        ("rtx4090", "RTX 4090"),
        ("4090", "RTX 4090"),
        ("RTX 4090", "RTX 4090"),
    ],
)
def test_get_gpu_accepts_loose_names(name: str, expected: str) -> None:
    assert get_gpu(name).name == expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama3-8b", "Llama3-8B"),
        ("meta-llama/Meta-Llama-3-8B-Instruct", "Llama3-8B"),
        ("QWEN2-7B", "Qwen2-7B"),
        ("qwen2.5-32b", "Qwen2.5-32B"),
        ("Qwen/Qwen2.5-32B-Instruct", "Qwen2.5-32B"),
    ],
)
def test_get_model_accepts_loose_names(name: str, expected: str) -> None:
    assert get_model(name).name == expected


def test_unknown_gpu_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="H200, H100, A100, A6000, RTX4090"):
        get_gpu("v100")


def test_unknown_model_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="Llama3-8B, Qwen2-7B, Qwen2.5-32B"):
        get_model("mistral-7b")


def test_registries_are_fresh_copies() -> None:
    gpu_specs().clear()
    model_specs().clear()
    assert get_gpu("h200").name == "H200"
    assert get_model("llama3-8b").name == "Llama3-8B"


def test_gpu_figures_are_dense_bf16_and_pcie_is_per_direction() -> None:
    h200, rtx4090 = get_gpu("h200"), get_gpu("4090")
    assert h200.bf16_flops_per_s == pytest.approx(989.5e12)
    assert h200.hbm_bytes_per_s == pytest.approx(4.8e12)
    assert rtx4090.memory_bytes == 24 * 2**30
    assert h200.pcie_bytes_per_s > rtx4090.pcie_bytes_per_s


def test_model_rejects_heads_not_multiple_of_kv_heads() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelSpec("bad", 2, 64, 6, 4, 16, 128, 100, False)
