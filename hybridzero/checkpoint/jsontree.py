"""Python state (optimizer hyperparameters, scheduler and scaler state, RNG) as JSON plus named tensors.

Nothing is ever unpickled: a value is encoded as JSON when it is ``None``, a bool, int, float (``NaN``/``inf``
included), str, list or dict with str keys; tuples, dicts with other keys or keys starting with ``$``, and tensors
use tagged single-key objects (``{"$tuple": [...]}``, ``{"$items": [[k, v], ...]}``, ``{"$tensor": name}``), the
tensors themselves going to a safetensors file under ``name``. Decoding is the exact inverse (shapes and dtypes
kept). Anything else is an error naming the path of the offending value.
"""

from __future__ import annotations

import json
from typing import Any

import torch

JSONValue = Any
_SCALARS = (bool, int, float, str, type(None))


def encode(obj: Any, tensors: dict[str, torch.Tensor], path: str) -> JSONValue:
    """JSON-able form of ``obj``; tensors are stored into ``tensors`` under their path."""
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, torch.Tensor):
        name = path or "$root"
        tensors[name] = obj.detach().cpu().contiguous().clone()
        return {"$tensor": name}
    if isinstance(obj, tuple):
        return {"$tuple": [encode(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in obj):
            return {k: encode(v, tensors, f"{path}/{k}") for k, v in obj.items()}
        return {
            "$items": [
                [encode(k, tensors, f"{path}/$key{i}"), encode(v, tensors, f"{path}/{i}")]
                for i, (k, v) in enumerate(obj.items())
            ]
        }
    raise TypeError(
        f"cannot store {type(obj).__name__} at '{path or '/'}' in a checkpoint: only None, bool, int, "
        "float, str, list, tuple, dict and tensors are stored (no pickled objects)"
    )


def decode(obj: JSONValue, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """Inverse of :func:`encode`; ValueError naming ``where`` for anything :func:`encode` never writes."""
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, list):
        return [decode(v, tensors, where) for v in obj]
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: unexpected JSON value {obj!r}")
    if len(obj) == 1 and next(iter(obj)).startswith("$"):
        tag, body = next(iter(obj.items()))
        if tag == "$tensor" and isinstance(body, str) and body in tensors:
            return tensors[body]
        if tag == "$tuple" and isinstance(body, list):
            return tuple(decode(v, tensors, where) for v in body)
        if tag == "$items" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
            return {_key(decode(k, tensors, where), where): decode(v, tensors, where) for k, v in body}
        raise ValueError(f"{where}: malformed tagged value {tag!r} (or tensor {body!r} missing)")
    if any(k.startswith("$") for k in obj):
        raise ValueError(f"{where}: unexpected key starting with '$' in {sorted(obj)}")
    return {k: decode(v, tensors, where) for k, v in obj.items()}


def _key(key: Any, where: str) -> Any:
    if isinstance(key, (list, dict)):
        raise ValueError(f"{where}: unhashable dict key {key!r}")
    return key


def check_plain_json(obj: Any, path: str = "client_state") -> None:
    """Raise TypeError naming the first value under ``obj`` that JSON cannot store as itself (tensors, objects,
    non-str keys, tuples become lists: allowed)."""
    if isinstance(obj, _SCALARS):
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_plain_json(v, f"{path}[{i}]")
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(
                    f"{path} has a non-string key {k!r} ({type(k).__name__}): checkpoint client_state "
                    "must be JSON (dict keys are strings)"
                )
            check_plain_json(v, f"{path}[{k!r}]")
        return
    raise TypeError(
        f"{path} is a {type(obj).__name__}: checkpoint client_state must be JSON-serialisable "
        "(None, bool, int, float, str, list, dict with str keys); convert it, e.g. tensor.tolist()"
    )


def dumps(obj: JSONValue) -> str:
    """Deterministic JSON text (NaN/inf allowed, as Python's json reads them back)."""
    return json.dumps(obj, indent=1, sort_keys=False)
