"""Strict construction of frozen dataclasses from YAML/JSON mappings.

One source of truth: each dataclass field's type annotation and `spec()` metadata give
the accepted type, bounds, choices and DeepSpeed aliases. Every violation becomes a
one-line ZsimInputError naming the dotted key, the value and the fix.
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

from zsim.errors import ZsimInputError, unknown_key

SCIENTIFIC = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")

# Every number zsim reads is a count, a size in bytes, a rate, a time or a fraction. Sizes and
# counts are int64 in DeepSpeed and torch (numel, bucket sizes), so a magnitude above 2**63 is
# never a real setting, and a nonzero magnitude below 1e-9 (a bandwidth of 1 B/s in GB/s, a
# fraction of a billionth) is not one either; both would only push zsim's times and bytes to
# inf/0 and the simulation into an unbounded run.
MAX_MAGNITUDE = 2.0 ** 63
MIN_NONZERO_MAGNITUDE = 1e-9


def spec(default=dataclasses.MISSING, *, ge=None, gt=None, le=None, alias=None, doc="",
         factory=dataclasses.MISSING):
    meta = {"ge": ge, "gt": gt, "le": le, "alias": alias, "doc": doc}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _number(value, path: str, want_int: bool):
    # YAML 1.1 reads 5e8 as a string, and DeepSpeed users write 5e8 in JSON: accept both.
    if isinstance(value, bool):
        raise ZsimInputError(path, value, "expected a number, not a boolean")
    if isinstance(value, str) and SCIENTIFIC.match(value.strip()):
        value = float(value)
    if not isinstance(value, (int, float)):
        kind = "an integer" if want_int else "a number"
        raise ZsimInputError(path, value, f"expected {kind} (e.g. 5e8)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ZsimInputError(path, value, "expected a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise ZsimInputError(path, value, "too large: zsim reads numbers up to 2**63 (DeepSpeed's int64 sizes)")
    if value and abs(value) < MIN_NONZERO_MAGNITUDE:
        raise ZsimInputError(path, value, "too small: zsim reads magnitudes of at least 1e-9 (or exactly 0, where the key "
                             "allows it)")
    if want_int:
        if isinstance(value, float):
            if not value.is_integer():
                raise ZsimInputError(path, value, "expected a whole number")
            value = int(value)
        return value
    return float(value)


def _coerce(tp, value, path: str):
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, path)
    if origin is Literal:
        choices = get_args(tp)
        # typed membership: `2.0 in (0, 1, 2, 3)` and `True in (0, 1)` hold in Python, so a float
        # or a boolean would pass as an integer choice; read integers the way int fields are read
        if all(isinstance(c, int) and not isinstance(c, bool) for c in choices):
            value = _number(value, path, want_int=True)
        elif not isinstance(value, str):
            raise ZsimInputError(path, value, f"choose one of {', '.join(map(str, choices))}")
        if value not in choices:
            from zsim.errors import did_you_mean
            hint = did_you_mean(str(value), [str(c) for c in choices])
            raise ZsimInputError(path, value, f"choose one of {', '.join(map(str, choices))}{hint}")
        return value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        return build(tp, value, path)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ZsimInputError(path, value, "expected a list")
        items = get_args(tp)
        if len(items) == 2 and items[1] is Ellipsis:
            return tuple(_coerce(items[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(items):
            raise ZsimInputError(path, value, f"expected a list of {len(items)} items")
        return tuple(_coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(items, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ZsimInputError(path, value, "expected a mapping")
        _, vt = get_args(tp)
        return {str(k): _coerce(vt, v, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ZsimInputError(path, value, "expected true or false")
        return value
    if tp is int:
        return _number(value, path, want_int=True)
    if tp is float:
        return _number(value, path, want_int=False)
    if tp is str:
        if not isinstance(value, str):
            raise ZsimInputError(path, value, "expected a string")
        return value
    if tp is Any:
        return value
    raise TypeError(f"unsupported field type {tp!r} at {path}")


def _check_bounds(meta, value, path):
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if meta.get("gt") is not None and not value > meta["gt"]:
        raise ZsimInputError(path, value, f"must be greater than {meta['gt']:g}")
    if meta.get("ge") is not None and not value >= meta["ge"]:
        raise ZsimInputError(path, value, f"must be at least {meta['ge']:g}")
    if meta.get("le") is not None and not value <= meta["le"]:
        raise ZsimInputError(path, value, f"must be at most {meta['le']:g}")


def accepted_keys(cls) -> dict[str, str]:
    """Map every accepted spelling (name and alias) to the field name."""
    keys = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        keys[f.name] = f.name
        if f.metadata.get("alias"):
            keys[f.metadata["alias"]] = f.name
    return keys


def build(cls, data, path: str = ""):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ZsimInputError(path or cls.__name__, data, "expected a mapping of keys to values")
    hints = typing.get_type_hints(cls)
    keys = accepted_keys(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in keys:
            raise unknown_key(path, str(key), keys.keys())
        name = keys[key]
        sub = f"{path}.{key}" if path else str(key)
        if name in kwargs:
            raise ZsimInputError(sub, value, f"'{name}' is given twice (under two spellings); keep one")
        coerced = _coerce(hints[name], value, sub)
        _check_bounds(by_name[name].metadata, coerced, sub)
        kwargs[name] = coerced
    missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        where = f"{path}.{missing[0]}" if path else missing[0]
        raise ZsimInputError(where, None, "this key is required")
    try:
        return cls(**kwargs)
    except ZsimInputError:
        raise
    except ValueError as exc:  # cross-field checks in __post_init__ raise ValueError(field, value, fix)
        if len(exc.args) == 3:
            field, value, fix = exc.args
            raise ZsimInputError(f"{path}.{field}" if path else field, value, fix) from None
        raise


def to_dict(obj) -> dict:
    """Dataclass -> plain dict (for JSON output), keeping field names."""
    return dataclasses.asdict(obj)
