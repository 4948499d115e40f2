"""`record`: a frozen, slotted dataclass whose instances are built three to four times faster.

A frozen dataclass's generated `__init__` stores each field through `object.__setattr__`
(a global lookup, an attribute lookup and a call per field): building a schedule creates some
100k ops, tags, allocations and payloads, and that was a fifth of a ZeRO-3 step's simulation.
`record` keeps everything the dataclass is (frozen, slots, eq, hash, repr, `replace`, the same
signature) and only swaps `__init__` for one that stores through each slot's own descriptor,
bound once. Field defaults must be plain values (no default_factory), the fields all positional
or all keyword-only (`record(kw_only=True)`), and the class must not define `__post_init__`:
`record` refuses anything else rather than build it differently. The workload's params and
modules are records too (a 175B workload builds some 1,200 of each).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, TypeVar, dataclass_transform, overload

T = TypeVar("T")


@overload
def record(cls: type[T], /) -> type[T]: ...


@overload
def record(*, kw_only: bool = False) -> Callable[[type[T]], type[T]]: ...


# a type checker sees a record as the frozen dataclass it is (PEP 681)
@dataclass_transform(frozen_default=True)
def record(cls: Any = None, *, kw_only: bool = False) -> Any:
    """`@record`, or `@record(kw_only=True)` for a class whose fields are all keyword-only (a
    dataclass's kw_only=True: required fields may then follow defaulted ones)."""
    if cls is None:
        return lambda c: _record(c, kw_only)
    return _record(cls, kw_only)


def _record(cls: type[T], kw_only: bool) -> type[T]:
    klass: Any = dataclasses.dataclass(frozen=True, slots=True, kw_only=kw_only)(cls)   # slots: a new class
    if hasattr(klass, "__post_init__"):
        raise TypeError(f"record {klass.__name__}: __post_init__ is not supported")
    fields = [f for f in dataclasses.fields(klass) if f.init]
    if len(fields) != len(dataclasses.fields(klass)) or any(f.default_factory is not dataclasses.MISSING
                                                         or f.kw_only != kw_only for f in fields):
        raise TypeError(f"record {klass.__name__}: only fields with plain defaults (no default_factory), all "
                        f"positional or all keyword-only, are supported")
    names = [f.name for f in fields]
    params = ", ".join(n if f.default is dataclasses.MISSING else f"{n}=_d_{n}" for n, f in zip(names, fields))
    if kw_only and params:
        params = "*, " + params
    body = "".join(f"        _s_{n}(self, {n})\n" for n in names) or "        pass\n"
    src = (f"def _make({', '.join([f'_s_{n}' for n in names] + [f'_d_{n}' for n in names])}):\n"
           f"    def __init__(self, {params}):\n{body}"
           f"    return __init__\n")
    namespace: dict = {}
    exec(src, namespace)   # noqa: S102 - the source is built from the class's own field names
    init = namespace["_make"](*(getattr(klass, n).__set__ for n in names), *(f.default for f in fields))
    init.__qualname__ = f"{klass.__qualname__}.__init__"
    init.__module__ = klass.__module__
    klass.__init__ = init
    return klass
