"""``deepspeed.ops`` (a package: ``adam``, ``adagrad``, ``lion``, ``op_builder``, ``aio``) and ``__compatible_ops__``
(op name -> whether hybridzero provides it, :mod:`hybridzero.ops.op_builder`). Other op packages (``lamb``,
``sparse_attention``, ...) are not provided: their import fails naming them."""

from __future__ import annotations

from hybridzero.ops.op_builder import COMPATIBLE_OPS

__compatible_ops__ = dict(COMPATIBLE_OPS)
