import pytest

from tokenflow.core.plan import attention_pairs
from tokenflow.sim.cost_model import CostModel, CostModelConfig
from tokenflow.sim.hardware import get_gpu, get_model, gpu_specs


@pytest.fixture
def h200_llama() -> CostModel:
    return CostModel(get_gpu("h200"), get_model("llama3-8b"), CostModelConfig())


def decode_time_s(cost: CostModel, batch: int, context: int) -> float:
    return cost.compute_time_s(0, 0, batch * context, batch)


def test_batch1_llama3_8b_on_h200_decodes_at_a_plausible_rate(h200_llama: CostModel) -> None:
    assert 100 <= h200_llama.decode_tokens_per_s(1, 1500) <= 250


def test_decode_is_bandwidth_bound_linear_in_context(h200_llama: CostModel) -> None:
    batch = 64
    times = [decode_time_s(h200_llama, batch, ctx) for ctx in (1000, 2000, 3000, 4000)]
    increments = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert increments[0] > 0
    # Equal context steps cost equal time: KV bytes / bandwidth.
    assert increments == pytest.approx([increments[0]] * 3, rel=1e-9)
    kv_s_per_token = 131072 / (4.8e12 * 0.8)
    assert increments[0] == pytest.approx(batch * 1000 * kv_s_per_token, rel=1e-9)


def test_small_decode_batches_cost_about_the_same(h200_llama: CostModel) -> None:
    # Memory-bound: the weights are read once, whatever the batch.
    t1 = decode_time_s(h200_llama, 1, 100)
    t8 = decode_time_s(h200_llama, 8, 100)
    assert t8 < 1.05 * t1


def test_prefill_is_compute_bound_linear_in_tokens(h200_llama: CostModel) -> None:
    def prefill_s(n: int) -> float:
        # No attention pairs: only the linear layers (and writing the new KV) remain.
        return h200_llama.compute_time_s(n, 0, 0, 0, num_prefill_samples=1)

    t4k, t8k = prefill_s(4096), prefill_s(8192)
    overhead = h200_llama.config.step_overhead_s
    assert (t8k - overhead) / (t4k - overhead) == pytest.approx(2.0, rel=0.01)
    flops = 2 * h200_llama.model.num_layer_params * 4096
    kv_write_bytes = 131072 * 4096
    expected = flops / (989.5e12 * 0.6) + kv_write_bytes / (4.8e12 * 0.8)
    assert t8k - t4k == pytest.approx(expected, rel=1e-9)


def test_prefill_attention_grows_quadratically(h200_llama: CostModel) -> None:
    short = h200_llama.compute_time_s(2048, attention_pairs(0, 2048), 0, 0)
    long = h200_llama.compute_time_s(2048, attention_pairs(30000, 2048), 0, 0)
    assert long > short * 1.5


def test_attention_pairs_counts_causal_pairs() -> None:
    assert attention_pairs(0, 3) == 1 + 2 + 3
    assert attention_pairs(10, 2) == 11 + 12


def test_empty_step_costs_nothing(h200_llama: CostModel) -> None:
    assert h200_llama.compute_time_s(0, 0, 0, 0) == 0.0


def test_step_overhead_is_charged_once(h200_llama: CostModel) -> None:
    bare = CostModel(h200_llama.gpu, h200_llama.model, CostModelConfig(step_overhead_s=0.0))
    diff = decode_time_s(h200_llama, 4, 500) - decode_time_s(bare, 4, 500)
    assert diff == pytest.approx(0.004)


def test_copy_time_is_latency_per_op_plus_bytes_over_effective_pcie(
    h200_llama: CostModel,
) -> None:
    assert h200_llama.copy_time_s(50_000_000_000) == pytest.approx(1.0 + 5e-6)
    assert h200_llama.copy_time_s(0, num_ops=10) == pytest.approx(50e-6)


def test_a_block_is_copied_as_one_piece_per_layer_k_and_v(h200_llama: CostModel) -> None:
    block_bytes = 16 * h200_llama.model.kv_bytes_per_token  # 2 MiB for Llama3-8B
    piece_s = 5e-6 + block_bytes / 64 / 50e9  # 32 layers x (K, V) = 64 pieces of 32 KiB
    assert h200_llama.block_copy_time_s(block_bytes) == pytest.approx(64 * piece_s)
    # far below the 50 GB/s the link moves in large copies
    assert block_bytes / h200_llama.block_copy_time_s(block_bytes) < 6e9


def test_copy_knobs_override_the_preset(h200_llama: CostModel) -> None:
    config = CostModelConfig(pcie_bytes_per_s=10e9, copy_latency_s=0.0, copy_pieces_per_block=1)
    custom = CostModel(h200_llama.gpu, h200_llama.model, config)
    assert custom.block_copy_time_s(10_000_000) == pytest.approx(1e-3)


def test_effective_pcie_is_below_peak_on_every_preset() -> None:
    for gpu in gpu_specs().values():
        assert 0.7 * gpu.pcie_peak_bytes_per_s <= gpu.pcie_bytes_per_s < gpu.pcie_peak_bytes_per_s
        assert 1e-6 <= gpu.copy_latency_s <= 1e-5


def test_kv_pool_bytes(h200_llama: CostModel) -> None:
    pool = h200_llama.kv_pool_bytes(0.3)
    assert pool == int(141 * 2**30 * 0.3) - h200_llama.model.weight_bytes


def test_kv_pool_rejects_a_model_that_does_not_fit() -> None:
    cost = CostModel(get_gpu("4090"), get_model("qwen2.5-32b"))
    with pytest.raises(ValueError, match="Qwen2.5-32B does not fit in 30% of RTX 4090"):
        cost.kv_pool_bytes(0.3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"compute_efficiency": 0.0},
        {"compute_efficiency": 1.5},
        {"bandwidth_efficiency": -0.1},
        {"step_overhead_s": -1.0},
        {"prefill_token_overhead_s": float("nan")},
    ],
)
def test_config_is_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CostModelConfig(**kwargs)


def test_rtx4090_is_slower_than_h200(h200_llama: CostModel) -> None:
    rtx = CostModel(get_gpu("4090"), get_model("llama3-8b"))
    assert rtx.decode_tokens_per_s(1, 1500) < h200_llama.decode_tokens_per_s(1, 1500) / 2
    assert rtx.prefill_tokens_per_s(2048) < h200_llama.prefill_tokens_per_s(2048) / 4
