"""The base of every config model, and the translation of pydantic's errors into :class:`ConfigError`.

A :class:`Block` is a frozen pydantic model of one JSON object of the DeepSpeed config: unknown keys are errors
(``extra="forbid"``), each field is a DeepSpeed key with its spellings (:func:`.values.key`), and ``_ignored``
names keys DeepSpeed accepts that hybridzero does not act on (accepted, dropped, warned about once by name).
Validation from JSON goes by alias only; Python code may also use field names (``ZeroConfig(stage=3)``) or
positional arguments in field order (``OffloadConfig("none", False)``).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar, cast

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from .errors import ConfigError, join_key, show, unknown_key_error
from .values import BlockProblem, ValueProblem, is_auto, key_info

__all__ = ["Block", "child_model", "spellings", "to_config_error"]


class Block(BaseModel):
    """A frozen, strict model of one DeepSpeed JSON object (see the module docstring)."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        validate_by_alias=True,
        validate_by_name=True,
        protected_namespaces=(),
        arbitrary_types_allowed=True,
    )
    _prefix: ClassVar[str] = ""  # the block's dotted path in error messages when built directly
    _ignored: ClassVar[frozenset[str]] = frozenset()
    _plain_names: ClassVar[bool] = False  # True: fields without key metadata are JSON keys spelt as the field
    # deprecated key -> the field it stands for (rewritten by _translate)
    _legacy: ClassVar[Mapping[str, str]] = MappingProxyType({})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names = list(type(self).model_fields)
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__} takes at most {len(names)} positional arguments")
        kwargs.update(zip(names, args))
        try:
            super().__init__(**kwargs)
        except ValidationError as exc:
            # pydantic also calls this __init__ for a block nested in another one: the outer error then
            # re-translates ``exc`` with the block's real path (see to_config_error)
            raise _BlockError(to_config_error(exc, type(self), type(self)._prefix), exc, type(self)) from None

    @model_validator(mode="before")
    @classmethod
    def _prepare(cls, data: Any) -> Any:
        """Drop ignored keys and ``"auto"`` on auto keys; reject non-string keys and two spellings of one key."""
        if not isinstance(data, Mapping):
            return data
        for name in data:
            if not isinstance(name, str):
                raise BlockProblem("{0} has a non-string key; JSON keys are strings", (repr(name),), name)
        for name, value in data.items():  # pydantic builds a nested block with ``cls(**value)``: check its keys here
            bad = [k for k in value if not isinstance(k, str)] if isinstance(value, Mapping) else []
            if bad:
                shown = repr(bad[0]).replace("{", "{{").replace("}", "}}")
                raise BlockProblem(f"{{0}} has a non-string key {shown}; JSON keys are strings", (name,), bad[0])
        out = cls._translate({k: v for k, v in data.items() if k not in cls._ignored})
        for field_name, field in cls.model_fields.items():
            info = key_info(field)
            if info is None:
                continue
            present = [s for s in (field_name, *info.spellings) if s in out]
            present = list(dict.fromkeys(present))
            if len(present) > 1:
                template = " and ".join(f"'{{{i}}}'" for i in range(len(present)))
                raise BlockProblem(
                    f"{template} set the same option; give only '{{{len(present)}}}'", (*present, info.name)
                )
            if present and info.auto and is_auto(out[present[0]]):
                del out[present[0]]
        return out

    @classmethod
    def _translate(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Rewrite legacy forms of the block's keys (``data`` is a fresh dict the hook may change)."""
        return data


class _BlockError(ConfigError):
    """A :class:`ConfigError` from building one block, keeping pydantic's error to re-phrase it at another path."""

    def __init__(self, error: ConfigError, origin: ValidationError, cls: type[Block]) -> None:
        super().__init__(str(error), key=error.key, value=error.value)
        self.origin, self.cls = origin, cls

    def __reduce__(self) -> tuple[Any, ...]:  # crosses process pipes as the plain ConfigError it reads as
        return _config_error, (str(self), self.key, self.value)


def _config_error(message: str, key: str | None, value: Any) -> ConfigError:
    return ConfigError(message, key=key, value=value)


def _model_class(annotation: Any) -> type[Block] | None:
    """The Block class inside ``annotation`` (``X``, ``X | None``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, Block):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        for arg in typing.get_args(annotation):
            found = _model_class(arg)
            if found is not None:
                return found
    return None


def spellings(cls: type[Block]) -> dict[str, str]:
    """Every JSON spelling accepted by ``cls`` -> its field name (ignored keys map to '')."""
    out: dict[str, str] = {name: "" for name in cls._ignored}
    out.update(cls._legacy)
    for field_name, field in cls.model_fields.items():
        info = key_info(field)
        if info is not None:
            out.update({s: field_name for s in info.spellings})
        elif cls._plain_names:
            out[field_name] = field_name
    return out


def child_model(cls: type[Block], name: str) -> type[Block] | None:
    """The Block class of the JSON key ``name`` inside ``cls``, if that key holds a block."""
    field_name = spellings(cls).get(name)
    return _model_class(cls.model_fields[field_name].annotation) if field_name else None


def _describe_loc(cls: type[Block], prefix: str, loc: tuple[Any, ...]) -> tuple[str, type[Block] | None]:
    """Dotted key of ``loc`` and the Block class that holds its last element."""
    path, holder = prefix, cast("type[Block] | None", cls)
    for i, part in enumerate(loc):
        name = str(part)
        field = holder.model_fields.get(name) if holder is not None else None
        info = key_info(field) if field is not None else None
        shown = info.name if info is not None else name  # a Python field name is shown as its JSON key
        if i < len(loc) - 1 and holder is not None:
            holder = child_model(holder, shown)
        path = join_key(path, shown)
    return path, holder


def to_config_error(exc: ValidationError, cls: type[Block], prefix: str) -> ConfigError:
    """The first error of ``exc`` (validating ``cls`` at dotted ``prefix``) as a :class:`ConfigError`."""
    err = exc.errors(include_url=False)[0]
    loc, value, kind = tuple(err["loc"]), err.get("input"), err["type"]
    dotted, holder = _describe_loc(cls, prefix, loc)
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, _BlockError):
        return to_config_error(cause.origin, cause.cls, dotted)
    if isinstance(cause, ConfigError):
        return cause
    if isinstance(cause, BlockProblem):
        keys = tuple(join_key(dotted, n) for n in cause.names)
        return ConfigError(cause.template.format(*keys), key=keys[0] if keys else dotted, value=cause.value)
    if isinstance(cause, ValueProblem):
        if cause.auto:
            return ConfigError(
                f"{dotted} = 'auto' cannot be resolved: 'auto' is filled in by the Hugging Face "
                f"Trainer, and there is none here; set {dotted} explicitly to {cause.expected}",
                key=dotted,
                value=value,
            )
        return ConfigError(f"{dotted} = {show(value)} is invalid: expected {cause.expected}", key=dotted, value=value)
    if kind == "extra_forbidden" and holder is not None:
        parent = dotted.rpartition(".")[0]
        return unknown_key_error(parent, str(loc[-1]), spellings(holder))
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return ConfigError(f"{dotted} = {show(value)} is invalid: expected a JSON object", key=dotted, value=value)
    return ConfigError(f"{dotted or 'config'} = {show(value)} is invalid: {err['msg']}", key=dotted, value=value)
