"""Block quantization for ZeRO++ (``hybridzero.comm.quantize``): error bound, edge sizes, int4 packing, wire format."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridzero.comm.quantize import (
    Quantized,
    dequantize_blockwise,
    error_bound,
    from_wire,
    pack_int4,
    quantize_blockwise,
    quantized_nbytes,
    to_wire,
    unpack_int4,
)

F32_MAX = torch.finfo(torch.float32).max


def _within_bound(x: torch.Tensor, q: Quantized) -> bool:
    """``|x - deq(q)| <= scale/2`` of each block, with slack for a few float32 roundings and one subnormal ulp."""
    err = (x.reshape(-1).float() - dequantize_blockwise(q)).abs()
    return bool((err <= error_bound(q) * (1 + 2**-13) + 2**-148).all())


def _int_values(q: Quantized) -> torch.Tensor:
    return q.data if q.bits == 8 else unpack_int4(q.data, 2 * q.data.numel())


formats = st.one_of(
    st.tuples(st.just(8), st.integers(1, 70)),
    st.tuples(st.just(4), st.integers(1, 35).map(lambda b: 2 * b)),
)
f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(f32, max_size=300), fmt=formats)
def test_round_trip_error_bound_arbitrary_floats(values: list[float], fmt: tuple[int, int]) -> None:
    bits, block = fmt
    x = torch.tensor(values, dtype=torch.float32)
    q = quantize_blockwise(x, bits=bits, block=block)
    assert _within_bound(x, q)
    assert bool(torch.isfinite(dequantize_blockwise(q)).all())
    assert bool((_int_values(q).abs() <= (127 if bits == 8 else 7)).all())


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    numel=st.integers(0, 20_000),
    log_scale=st.integers(-140, 120),
    fmt=formats,
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_round_trip_error_bound_random_normal(
    seed: int, numel: int, log_scale: int, fmt: tuple[int, int], dtype: torch.dtype
) -> None:
    bits, block = fmt
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(numel, generator=gen, dtype=torch.float64) * 2.0**log_scale).to(dtype)
    x = torch.nan_to_num(x, posinf=0.0, neginf=0.0)  # fp16/bf16 overflow at large scales
    q = quantize_blockwise(x, bits=bits, block=block)
    assert _within_bound(x, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [8, 4])
def test_dtypes_and_shapes(dtype: torch.dtype, bits: int) -> None:
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(1)).to(dtype)
    before = x.clone()
    q = quantize_blockwise(x.transpose(0, 2), bits=bits, block=16)  # non-contiguous input
    assert torch.equal(x, before)  # input untouched
    assert q.numel == 105 and q.n_blocks == 7
    assert _within_bound(x.transpose(0, 2), q)
    deq = dequantize_blockwise(q, dtype=dtype)
    assert deq.dtype == dtype and deq.shape == (105,)
    assert torch.equal(deq, dequantize_blockwise(q).to(dtype))


@pytest.mark.parametrize("bits", [8, 4])
def test_all_zero_blocks_decode_to_exact_zeros(bits: int) -> None:
    x = torch.zeros(5 * 8 + 3)
    x[8:16] = torch.linspace(-3, 2, 8)
    x[-2] = 1e-3
    x[20] = -0.0
    q = quantize_blockwise(x, bits=bits, block=8)
    assert q.scales.tolist()[0] == 0.0 and q.scales.tolist()[2:5] == [0.0, 0.0, 0.0]
    deq = dequantize_blockwise(q)
    zero = torch.ones_like(x, dtype=torch.bool)
    zero[8:16] = False
    zero[-3:] = False
    assert torch.equal(deq[zero], torch.zeros(int(zero.sum())))
    assert torch.equal(error_bound(q)[zero], torch.zeros(int(zero.sum())))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [0, 1, 7, 63, 64, 65, 3 * 64 + 5])
def test_odd_sizes_pad_at_end_only(bits: int, numel: int) -> None:
    block = 64
    x = torch.arange(1, numel + 1, dtype=torch.float32) * 0.37
    q = quantize_blockwise(x, bits=bits, block=block)
    n_blocks = -(-numel // block)
    assert q.n_blocks == n_blocks and q.scales.shape == (n_blocks,)
    assert q.data.shape == (n_blocks * block * bits // 8,)
    assert torch.equal(_int_values(q)[numel:], torch.zeros(n_blocks * block - numel, dtype=torch.int8))
    deq = dequantize_blockwise(q)
    assert deq.shape == (numel,)
    assert _within_bound(x, q)
    assert error_bound(q).shape == (numel,)


def test_round_half_to_even_and_clamp_to_qmax() -> None:
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5, -127.0, 3.49])  # absmax 127 -> scale exactly 1
    q = quantize_blockwise(x, bits=8, block=8)
    assert q.scales.tolist() == [1.0]
    assert q.data[:7].tolist() == [127, 0, 2, 2, -2, -127, 3]
    q4 = quantize_blockwise(torch.tensor([7.0, 0.5, 1.5, 2.5, -2.5, -7.0]), bits=4, block=6)
    assert q4.scales.tolist() == [1.0]
    assert unpack_int4(q4.data, 6).tolist() == [7, 0, 2, 2, -2, -7]


@pytest.mark.parametrize("bits", [8, 4])
def test_deterministic(bits: int) -> None:
    x = torch.randn(10_001, generator=torch.Generator().manual_seed(3))
    a, b = quantize_blockwise(x, bits=bits, block=256), quantize_blockwise(x.clone(), bits=bits, block=256)
    assert torch.equal(a.data, b.data) and torch.equal(a.scales, b.scales)
    assert torch.equal(to_wire(a), to_wire(b))


def test_float32_extremes_stay_finite_and_bounded() -> None:
    tiny = torch.finfo(torch.float32).tiny
    ulp = 2.0**-149  # smallest subnormal: scales of a few ulps need rounding up to cover the block maximum
    x = torch.tensor([F32_MAX, -F32_MAX, 1e-45, -3e-45, tiny, tiny / 3, 1e-40, 0.0, 190 * ulp, 0.0, 3 * ulp, 0.0])
    for bits, block in [(8, 1), (8, 2), (8, 8), (4, 2), (4, 8)]:
        q = quantize_blockwise(x, bits=bits, block=block)
        assert bool(torch.isfinite(dequantize_blockwise(q)).all())
        assert _within_bound(x, q)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_raises_with_count_and_first_index(bad: float, dtype: torch.dtype) -> None:
    x = torch.ones(5000, dtype=dtype)
    x[1234] = bad
    x[4999] = bad
    with pytest.raises(ValueError, match=r"2 non-finite element\(s\).*first at flat index 1234"):
        quantize_blockwise(x, block=2048)


def test_float64_overflow_raises() -> None:
    x = torch.tensor([1.0, 1e300], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"1 non-finite element\(s\).*first at flat index 1"):
        quantize_blockwise(x)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"bits": 3}, "bits=3"),
        ({"bits": 16}, "bits=16"),
        ({"block": 0}, "block=0"),
        ({"block": -4}, "block=-4"),
        ({"bits": 4, "block": 3}, "block=3"),
    ],
)
def test_bad_arguments_raise(kwargs: dict[str, int], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        quantize_blockwise(torch.ones(4), **kwargs)
    with pytest.raises(ValueError, match=pattern):
        quantized_nbytes(4, bits=kwargs.get("bits", 8), block=kwargs.get("block", 2048))


def test_non_float_input_raises() -> None:
    with pytest.raises(TypeError, match="int64"):
        quantize_blockwise(torch.arange(4))


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(-8, 7), max_size=101))
def test_int4_pack_round_trips_exactly(values: list[int]) -> None:
    v = torch.tensor(values, dtype=torch.int8)
    packed = pack_int4(v)
    assert packed.dtype == torch.int8 and packed.numel() == (len(values) + 1) // 2
    assert torch.equal(unpack_int4(packed, len(values)), v)


def test_int4_nibble_layout_and_errors() -> None:
    assert pack_int4(torch.tensor([1, -1], dtype=torch.int8)).view(torch.uint8).tolist() == [0xF1]
    assert pack_int4(torch.tensor([-7, 7, 3], dtype=torch.int8)).view(torch.uint8).tolist() == [0x79, 0x03]
    with pytest.raises(ValueError, match="max=9"):
        pack_int4(torch.tensor([0, 9], dtype=torch.int8))
    with pytest.raises(ValueError, match="int8"):
        pack_int4(torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="numel=5"):
        unpack_int4(torch.zeros(4, dtype=torch.int8), 5)


@settings(max_examples=100, deadline=None)
@given(numel=st.integers(0, 3000), fmt=formats, seed=st.integers(0, 2**31 - 1))
def test_wire_round_trip(numel: int, fmt: tuple[int, int], seed: int) -> None:
    bits, block = fmt
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    q = quantize_blockwise(x, bits=bits, block=block)
    wire = to_wire(q)
    assert wire.dtype == torch.uint8 and wire.numel() == quantized_nbytes(numel, bits=bits, block=block)
    back = from_wire(wire, numel, bits, block)
    assert torch.equal(back.data, q.data) and torch.equal(back.scales, q.scales)
    assert torch.equal(dequantize_blockwise(back), dequantize_blockwise(q))


@pytest.mark.parametrize(("bits", "block"), [(8, 3), (8, 2048), (4, 6)])
def test_wire_tensors_concatenate_like_an_all_gather(bits: int, block: int) -> None:
    """Equal-numel shards give equal-size wire tensors; slices of the gathered buffer (even unaligned) decode."""
    gen = torch.Generator().manual_seed(7)
    shards = [torch.randn(1001, generator=gen) * (r + 1) for r in range(3)]
    wires = [to_wire(quantize_blockwise(s, bits=bits, block=block)) for s in shards]
    size = quantized_nbytes(1001, bits=bits, block=block)
    assert all(w.numel() == size for w in wires)
    gathered = torch.cat(wires)
    for r, shard in enumerate(shards):
        q = from_wire(gathered[r * size : (r + 1) * size], 1001, bits, block)
        assert _within_bound(shard, q)
    with pytest.raises(ValueError, match="wire buffer"):
        from_wire(gathered[: size - 1], 1001, bits, block)


def test_compression_ratio() -> None:
    numel = 1 << 22
    fp32_bytes = 4 * numel
    assert fp32_bytes / quantized_nbytes(numel, bits=8, block=2048) == pytest.approx(4.0, rel=0.01)
    assert fp32_bytes / quantized_nbytes(numel, bits=4, block=2048) == pytest.approx(8.0, rel=0.01)
    assert quantized_nbytes(0, bits=8, block=2048) == 0
    assert quantized_nbytes(1, bits=4, block=2) == 1 + 4


def test_dequantize_into_out() -> None:
    x = torch.randn(300, generator=torch.Generator().manual_seed(5))
    q = quantize_blockwise(x, bits=8, block=128)
    out = torch.empty(300, dtype=torch.bfloat16)
    assert dequantize_blockwise(q, out=out) is out
    assert torch.equal(out, dequantize_blockwise(q).to(torch.bfloat16))
    with pytest.raises(ValueError, match="300 elements"):
        dequantize_blockwise(q, out=torch.empty(299))
    with pytest.raises(ValueError, match="300 elements"):
        dequantize_blockwise(q, out=torch.empty(3, 100))


def test_quantized_rejects_inconsistent_fields() -> None:
    q = quantize_blockwise(torch.randn(100), bits=8, block=32)
    with pytest.raises(ValueError, match="data"):
        Quantized(data=q.data[:-1], scales=q.scales, numel=100, bits=8, block=32)
    with pytest.raises(ValueError, match="scales"):
        Quantized(data=q.data, scales=q.scales.double(), numel=100, bits=8, block=32)
    with pytest.raises(ValueError, match="bits=5"):
        Quantized(data=q.data, scales=q.scales, numel=100, bits=5, block=32)


@pytest.mark.parametrize(("bits", "max_rel_rms"), [(8, 0.01), (4, 0.2)])
def test_normal_data_error_level(bits: int, max_rel_rms: float) -> None:
    """On N(0, 1) with block 2048: int8 relative RMS error ~0.8%, int4 ~15%."""
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    q = quantize_blockwise(x, bits=bits, block=2048)
    err = x - dequantize_blockwise(q)
    assert float(err.pow(2).mean().sqrt() / x.pow(2).mean().sqrt()) < max_rel_rms
    assert _within_bound(x, q)
