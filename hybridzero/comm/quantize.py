"""Pure block quantization for ZeRO++ communication (qwZ weight all-gather, qgZ gradient reduce-scatter).

ZeRO++ shrinks the two big ZeRO-3 collectives by sending low-bit integers plus one scale per block:

* **qwZ** (quantized weights): each rank quantizes its own fp16/bf16 parameter shard to int8, the ranks all-gather the
  fixed-size wire tensors (:func:`to_wire`), and every rank dequantizes all shards to rebuild the full parameter.
* **qgZ** (quantized gradients): instead of a ring reduce-scatter (which would requantize at every hop), each rank
  quantizes its gradient chunks (int4), exchanges them with an all-to-all, dequantizes the chunks it owns and sums them
  in fp32. One quantization per hop level keeps the error bounded.

Scheme (symmetric, per block)::

    x (flattened, float32, zero-padded at the end to n_blocks * block)
    scale[b] = max|x[b]| / qmax            qmax = 127 (int8) or 7 (int4)
    q[i]     = clamp(round_half_even(x[i] / scale[b]), -qmax, qmax)
    deq[i]   = q[i] * scale[b]

Invariants (tested in ``tests/unit/test_quantize.py``):

* round trip: ``|x[i] - deq[i]| <= scale[b] / 2`` for element ``i`` of block ``b`` (:func:`error_bound`), up to a few
  float32 roundings (relative ``2**-15`` of the scale, plus one subnormal ulp);
* an all-zero block has scale 0 and decodes to exact zeros; padding lives at the end only and decodes to zeros;
* quantization is deterministic (pure element-wise tensor ops, no randomness);
* ``pack_int4`` / ``unpack_int4`` round-trip exactly for values in ``[-8, 7]``;
* ``quantized_nbytes(numel, bits=, block=) == to_wire(q).numel()`` and is the same for every rank with the same numel,
  so wire tensors can be all-gathered or all-to-all'ed directly;
* inf/nan inputs raise :class:`ValueError` (never silently encoded).

All functions are pure: no module-level mutable state, inputs are never modified (except ``out`` in
:func:`dequantize_blockwise`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

_QMAX: Mapping[int, int] = MappingProxyType({8: 127, 4: 7})
_SCALE_BYTES = 4  # float32 scales


def _check_format(bits: int, block: int) -> int:
    """Validate ``bits`` / ``block`` and return ``qmax``. Raises ValueError naming the bad argument."""
    if isinstance(bits, bool) or bits not in _QMAX:
        raise ValueError(f"bits must be 8 or 4, got bits={bits!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be an int >= 1, got block={block!r}")
    if bits == 4 and block % 2:
        raise ValueError(f"block must be even for bits=4 (two values per byte), got block={block}")
    return _QMAX[bits]


def _num_blocks(numel: int, block: int) -> int:
    """``ceil(numel / block)``; 0 for an empty tensor."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got numel={numel}")
    return -(-numel // block)


@dataclass(frozen=True, eq=False)
class Quantized:
    """A block-quantized flat tensor.

    Invariants (checked on construction, without device syncs):

    * ``scales`` is float32 ``[n_blocks]`` with ``n_blocks = ceil(numel / block)``;
    * ``data`` is int8 ``[n_blocks * block]`` for ``bits == 8``, or ``[n_blocks * block // 2]`` for ``bits == 4``
      (element ``2k`` in the low nibble of byte ``k``, element ``2k + 1`` in the high nibble);
    * elements ``numel..n_blocks * block - 1`` are padding (quantized zeros), at the end only.

    ``eq=False``: tensors have no boolean equality, so identity comparison is kept.
    """

    data: torch.Tensor
    scales: torch.Tensor
    numel: int
    bits: int
    block: int

    def __post_init__(self) -> None:
        _check_format(self.bits, self.block)
        n_blocks = _num_blocks(self.numel, self.block)
        want_data = n_blocks * self.block * self.bits // 8
        if self.data.dtype != torch.int8 or self.data.shape != (want_data,):
            raise ValueError(
                f"Quantized.data must be int8 [{want_data}] for numel={self.numel}, bits={self.bits}, "
                f"block={self.block}; got {self.data.dtype} {tuple(self.data.shape)}"
            )
        if self.scales.dtype != torch.float32 or self.scales.shape != (n_blocks,):
            raise ValueError(
                f"Quantized.scales must be float32 [{n_blocks}]; got {self.scales.dtype} {tuple(self.scales.shape)}"
            )
        if self.data.device != self.scales.device:
            raise ValueError(f"data on {self.data.device} but scales on {self.scales.device}")

    @property
    def n_blocks(self) -> int:
        """Number of blocks (``ceil(numel / block)``)."""
        return int(self.scales.numel())


def quantized_nbytes(numel: int, *, bits: int, block: int) -> int:
    """Bytes on the wire for ``numel`` elements: payload ``n_blocks * block * bits / 8`` plus 4 bytes per scale.

    Invariant: equals ``to_wire(quantize_blockwise(x, bits=bits, block=block)).numel()`` for any ``x`` of ``numel``
    elements. For large inputs this is ~1/4 (int8) or ~1/8 (int4) of the float32 bytes, plus ``4 / block`` per element.
    """
    _check_format(bits, block)
    n_blocks = _num_blocks(numel, block)
    return n_blocks * block * bits // 8 + n_blocks * _SCALE_BYTES


def _pack_pairs(values: torch.Tensor) -> torch.Tensor:
    """Pack an even-length int8 tensor of values in ``[-8, 7]`` two per byte (low nibble first). No range check."""
    v = values.to(torch.int16) & 0xF
    byte = v[0::2] | (v[1::2] << 4)  # 0..255
    return torch.where(byte >= 128, byte - 256, byte).to(torch.int8)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Pack int8 ``values`` (any shape, flattened; intended range ``[-7, 7]``, ``[-8, 7]`` accepted) two per byte.

    Element ``2k`` goes to the low nibble of byte ``k`` and ``2k + 1`` to the high nibble, as two's-complement nibbles.
    An odd count is padded with one zero nibble. Returns int8 ``[ceil(n / 2)]``.
    Invariant: ``unpack_int4(pack_int4(v), v.numel()) == v.flatten()`` exactly. Out-of-range values raise ValueError
    (this check costs one device sync; :func:`quantize_blockwise` packs internally without it).
    """
    if values.dtype != torch.int8:
        raise ValueError(f"pack_int4 needs int8 values, got dtype={values.dtype}")
    flat = values.reshape(-1)
    if flat.numel() and bool(((flat < -8) | (flat > 7)).any()):
        lo, hi = int(flat.min()), int(flat.max())
        raise ValueError(f"pack_int4 values must lie in [-8, 7], got min={lo}, max={hi}")
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return _pack_pairs(flat)


def unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int8 ``[numel]`` with values in ``[-8, 7]`` (sign-extended nibbles).

    ``numel`` must be ``2 * packed.numel()`` or one less (odd count).
    """
    if packed.dtype != torch.int8:
        raise ValueError(f"unpack_int4 needs int8 packed bytes, got dtype={packed.dtype}")
    flat = packed.reshape(-1)
    if numel not in (2 * flat.numel(), 2 * flat.numel() - 1) or numel < 0:
        raise ValueError(f"numel={numel} does not fit {flat.numel()} packed bytes (need 2*bytes or 2*bytes-1)")
    b = flat.to(torch.int16)
    low = ((b & 0xF) ^ 8) - 8  # sign-extend the low nibble
    high = (((b >> 4) & 0xF) ^ 8) - 8
    return torch.stack([low, high], dim=1).reshape(-1)[:numel].to(torch.int8)


def _block_scales(absmax: torch.Tensor, qmax: int) -> torch.Tensor:
    """Per-block scales ``absmax / qmax`` (float32, finite ``absmax``), nudged by one ulp at the float32 extremes.

    * Subnormal scales have little relative precision: if ``qmax * scale < absmax`` the scale is rounded up one ulp
      so the largest element still maps to ``|q| <= qmax`` within the ``scale / 2`` bound.
    * Near ``float32.max``, ``qmax * scale`` can round to inf: the scale is rounded down one ulp so decoding stays
      finite (the clamp error this adds is a few ulps of ``absmax``, far below ``scale / 2``).
    An all-zero block keeps scale exactly 0.
    """
    scale = absmax / qmax
    up = (scale < torch.finfo(torch.float32).tiny) & (scale * qmax < absmax)
    scale = torch.where(up, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)
    down = torch.isinf(scale * qmax)
    return torch.where(down, torch.nextafter(scale, torch.zeros_like(scale)), scale)


def _raise_non_finite(flat: torch.Tensor) -> None:
    """Raise ValueError naming how many elements of ``flat`` are inf/nan and the first flat index."""
    bad = ~torch.isfinite(flat)
    count = int(bad.sum())
    first = int(bad.to(torch.uint8).argmax())
    raise ValueError(
        f"quantize_blockwise: input has {count} non-finite element(s) (inf/nan, or beyond float32 range) "
        f"out of {flat.numel()}; first at flat index {first} (value {flat[first].item()})"
    )


def quantize_blockwise(x: torch.Tensor, *, bits: int = 8, block: int = 2048) -> Quantized:
    """Quantize ``x`` (any float dtype and shape, flattened) symmetrically per block of ``block`` elements.

    Values are converted to float32 (exact for fp16/bf16), padded with zeros to ``n_blocks * block``, scaled by
    ``scale = max|x_block| / qmax`` (see :func:`_block_scales`), rounded half-to-even and clamped to
    ``[-qmax, qmax]`` (127 for int8, 7 for int4). ``numel == 0`` gives an empty :class:`Quantized`.

    Invariants: ``|x - dequantize_blockwise(q)| <= error_bound(q)`` (plus float32 rounding); all-zero blocks have
    scale 0; the result is a deterministic function of ``(x, bits, block)``; ``x`` is not modified.
    Raises ValueError for bad ``bits``/``block`` or any inf/nan (count and first index in the message), TypeError for
    a non-floating ``x``. Costs one device sync (the finiteness check on the per-block maxima).
    """
    qmax = _check_format(bits, block)
    if not x.is_floating_point():
        raise TypeError(f"quantize_blockwise needs a floating-point tensor, got dtype={x.dtype}")
    numel = x.numel()
    n_blocks = _num_blocks(numel, block)
    buf = torch.zeros(n_blocks * block, dtype=torch.float32, device=x.device)
    buf[:numel].copy_(x.reshape(-1))
    blocks = buf.view(n_blocks, block)
    absmax = blocks.abs().amax(dim=1)
    if not bool(torch.isfinite(absmax).all()):
        _raise_non_finite(buf[:numel])
    scales = _block_scales(absmax, qmax)
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = (blocks / divisor[:, None]).round_().clamp_(-qmax, qmax).to(torch.int8).reshape(-1)
    data = _pack_pairs(q) if bits == 4 else q
    return Quantized(data=data, scales=scales, numel=numel, bits=bits, block=block)


def _int_values(q: Quantized) -> torch.Tensor:
    """The quantized integers of ``q`` as int8 ``[n_blocks * block]`` (padding included)."""
    if q.bits == 8:
        return q.data
    return unpack_int4(q.data, 2 * q.data.numel())


def dequantize_blockwise(
    q: Quantized, *, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Decode ``q`` to a flat ``[numel]`` tensor: ``deq[i] = q[i] * scale[block of i]`` computed in float32.

    With ``out`` (1-D, ``numel`` elements, same device) the result is written into it in place (cast to
    ``out.dtype``, which then takes precedence over ``dtype``) and ``out`` is returned. Padding is dropped.
    Invariant: all-zero blocks decode to exact zeros; ``|x - deq| <= error_bound(q)`` for float32 output.
    """
    values = _int_values(q).to(torch.float32).view(q.n_blocks, q.block)
    flat = (values * q.scales[:, None]).reshape(-1)[: q.numel]
    if out is None:
        return flat.to(dtype)
    if out.dim() != 1 or out.numel() != q.numel:
        raise ValueError(f"out must be 1-D with {q.numel} elements, got shape {tuple(out.shape)}")
    if out.device != flat.device:
        raise ValueError(f"out is on {out.device} but q is on {flat.device}")
    return out.copy_(flat)


def error_bound(q: Quantized) -> torch.Tensor:
    """Per-element worst-case round-trip error ``scale / 2`` of each element's block, float32 ``[numel]``.

    Exact-arithmetic bound; float32 evaluation adds at most ~``2**-15 * scale`` (plus one subnormal ulp).
    """
    half = (q.scales / 2)[:, None].expand(q.n_blocks, q.block)
    return half.reshape(-1)[: q.numel]


def to_wire(q: Quantized) -> torch.Tensor:
    """Serialize ``q`` to one flat uint8 tensor for a collective (same device as ``q``).

    Layout (native byte order; all ranks of a job share it)::

        [ scales: n_blocks * 4 bytes (float32) | data: n_blocks * block * bits / 8 bytes (int8 / packed int4) ]

    Invariant: ``to_wire(q).numel() == quantized_nbytes(q.numel, bits=q.bits, block=q.block)``, which depends only on
    ``(numel, bits, block)``, so equal-numel shards give equal-size wire tensors. ``numel``/``bits``/``block`` are not
    on the wire: both sides must agree on them (they come from the shared parameter layout).
    """
    return torch.cat([q.scales.view(torch.uint8), q.data.view(torch.uint8)])


def from_wire(buf: torch.Tensor, numel: int, bits: int, block: int) -> Quantized:
    """Inverse of :func:`to_wire`. ``buf`` must be 1-D uint8 of ``quantized_nbytes(numel, bits=, block=)`` bytes.

    The data is a zero-copy view of ``buf``; the scales are a view too when their bytes are 4-byte aligned in storage
    (e.g. a slice of an all-gather output at an unaligned offset), otherwise a small copy.
    """
    want = quantized_nbytes(numel, bits=bits, block=block)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != want:
        raise ValueError(
            f"wire buffer must be uint8 [{want}] for numel={numel}, bits={bits}, block={block}; "
            f"got {buf.dtype} {tuple(buf.shape)}"
        )
    n_scale_bytes = _num_blocks(numel, block) * _SCALE_BYTES
    scale_bytes = buf[:n_scale_bytes]
    if scale_bytes.storage_offset() % _SCALE_BYTES or not scale_bytes.is_contiguous():
        scale_bytes = scale_bytes.clone()
    scales = scale_bytes.view(torch.float32)
    data = buf[n_scale_bytes:].view(torch.int8)
    return Quantized(data=data, scales=scales, numel=numel, bits=bits, block=block)
