"""Fill a flat range of a group's buffer from a :class:`~hybridzero.tensor_source.TensorSource`, parameter by
parameter.

The one function through which any state indexed like a group's flat buffer (master weights, optimizer moments)
is read from a checkpoint or a Hugging Face directory, whatever world size or grouping wrote it: positions come from
the group's :class:`~hybridzero.zero.layout.ParamSpec` metadata, values from the source by parameter name (any
alias). Alignment gaps and padding stay zero; specs listed in ``skip`` are left as ``out`` held them. A float buffer
is never filled from an integer or bool tensor (ValueError naming it); float dtypes convert.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch

from hybridzero.tensor_source import TensorSource, check_float, resolve_name
from hybridzero.zero.layout import ParamSpec, intersect


def read_range(
    specs: Sequence[ParamSpec],
    lo: int,
    hi: int,
    source: TensorSource,
    aliases: Mapping[str, Sequence[str]],
    out: torch.Tensor | None = None,
    skip: Collection[str] = (),
) -> torch.Tensor:
    """Elements ``[lo, hi)`` of a flat buffer laid out by ``specs`` (fp32 unless ``out`` says otherwise).

    Without ``skip`` the result is exactly the source's values with zero padding (``out`` is zeroed first); with
    ``skip``, ``out`` keeps its values at the skipped parameters' elements and everything else is overwritten.
    """
    if out is None:
        out = torch.zeros(hi - lo, dtype=torch.float32)
    elif not skip:
        out.zero_()
    for spec in specs:
        hit = intersect((lo, hi), (spec.offset, spec.end))
        if hit is None or spec.name in skip:
            continue
        key = resolve_name(source, aliases.get(spec.name, (spec.name,)))
        piece = source.read_flat(key, hit[0] - spec.offset, hit[1] - spec.offset)
        if out.is_floating_point():
            check_float(key, source, piece.dtype)
        out[hit[0] - lo : hit[1] - lo].copy_(piece)
    return out
