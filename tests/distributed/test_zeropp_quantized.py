"""qwZ and qgZ: training still converges like the baseline, and the ledger shows the expected byte reductions."""
from __future__ import annotations

import pytest

from hybridzero.testing.zeropp import zeropp_run

TWO_BY_TWO = {"LOCAL_WORLD_SIZE": "2"}
CONFIGS = {
    "baseline": {},
    "qwz": {"zero_quantized_weights": True},
    "qgz": {"zero_quantized_gradients": True},
    "both": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
    "all_three": {"zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": 2},
    "qgz_int4": {"zero_quantized_gradients": True, "zero_quantized_gradients_bits": 4},
}


def _runs(world, steps: int, bench_model: bool, names: list[str]) -> dict[str, dict]:
    pool = world(4, env=TWO_BY_TWO)
    return {n: pool.run(zeropp_run, {**CONFIGS[n], "zero_quantization_block_size": 256}, steps, bench_model,
                        timeout=600)[0] for n in names}


def _check(runs: dict[str, dict], tolerance: float, window: int) -> None:
    """Mean loss of the last ``window`` steps within ``tolerance`` of the baseline's; bytes drop as expected."""
    base = runs["baseline"]
    final = sum(base["losses"][-window:]) / window
    assert final < base["losses"][0] - 0.05, "the baseline must learn for the comparison to mean anything"
    for name, r in runs.items():
        mine = sum(r["losses"][-window:]) / window
        assert abs(mine - final) <= tolerance * final, (name, mine, final)
    gather = base["bytes_per_step"]["all_gather/world"]
    scatter = base["bytes_per_step"]["reduce_scatter/world"]
    q = runs["qwz"]["bytes_per_step"]
    assert q["all_gather/world"] <= gather / 3.5  # int8 + fp32 scales per block vs fp32
    g = runs["qgz"]["bytes_per_step"]
    assert "reduce_scatter/world" not in g and g["reduce_scatter/cross"] <= scatter / 7  # quantized, one per node
    a = runs["all_three"]["bytes_per_step"]
    assert a["all_gather/world"] == q["all_gather/world"] / 2  # backward gathers left the world group (hpZ)


def test_quantized_collectives_tiny_model(world) -> None:
    _check(_runs(world, 20, False, list(CONFIGS)), tolerance=0.02, window=5)


@pytest.mark.slow
def test_quantized_collectives_benchmark_model_50_steps(world) -> None:
    """The issue's criterion: the benchmark Llama, 50 steps at world 4 as 2 nodes x 2 (lr 1e-3): the mean loss of
    the last 10 steps within 2% of the baseline's (measured: qwZ -1.9%, qgZ +0.5%, all three -1.2%)."""
    _check(_runs(world, 50, True, ["baseline", "qwz", "qgz", "all_three"]), tolerance=0.02, window=10)


def test_qgz_needs_a_usable_node_layout(world) -> None:
    from hybridzero.testing.spawn import RemoteError

    from hybridzero.testing.zeropp import zeropp_run_with_local_size

    with pytest.raises(RemoteError) as info:
        world(4).run(zeropp_run_with_local_size, "3", {"zero_quantized_gradients": True})
    assert "LOCAL_WORLD_SIZE=3" in str(info.value) and "world size 4" in str(info.value)
    with pytest.raises(RemoteError) as info:
        world(2).run(zeropp_run, {"zero_quantized_gradients": True, "zero_quantized_gradients_bits": 5}, 1)
    assert "zero_quantized_gradients_bits=5" in str(info.value)
