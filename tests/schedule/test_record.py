"""zsim/record.py: a record is the frozen, slotted dataclass it replaces, built faster."""
import dataclasses
import inspect

import pytest

from zsim.record import record
from zsim.schedule import ir, payloads
from zsim.workload import module

RECORDS = [ir.Tag, ir.Alloc, ir.Op, ir.ProcessGroup, ir.HostSettings, payloads.ComputeWork, payloads.ModulePass,
           payloads.StepCompute, payloads.Comm, payloads.ParamGather, payloads.GradReduce, payloads.ScalarAllReduce,
           payloads.TokenExchange, payloads.Copy, payloads.CpuAdam, payloads.PipeTransfer, payloads.TensorComm,
           module.Param, module.Module]


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_record_keeps_the_dataclass_signature_and_freezes(cls):
    fields = dataclasses.fields(cls)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    assert [(p.name, p.default) for p in params] == [
        (f.name, inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default) for f in fields]
    assert "__dict__" not in dir(cls) and cls.__dataclass_params__.frozen


def test_record_builds_what_the_dataclass_builds():
    @dataclasses.dataclass(frozen=True, slots=True)
    class Plain:
        a: int
        b: str = "x"
        c: tuple = ()

    @record
    class Fast:
        a: int
        b: str = "x"
        c: tuple = ()

    for args, kwargs in [((1,), {}), ((1, "y"), {}), ((1,), {"c": (2,)}), ((), {"a": 3, "b": "z"})]:
        p, f = Plain(*args, **kwargs), Fast(*args, **kwargs)
        assert dataclasses.astuple(p) == dataclasses.astuple(f)
        assert repr(f).replace("Fast", "Plain") == repr(p)
        assert f == Fast(*args, **kwargs) and hash(f) == hash(Fast(*args, **kwargs))
        assert dataclasses.replace(f, a=9).a == 9
    with pytest.raises(dataclasses.FrozenInstanceError):
        Fast(1).a = 2
    with pytest.raises(TypeError):
        Fast()
    with pytest.raises(TypeError):
        Fast(1, b="y", d=2)


def test_record_refuses_what_it_would_build_differently():
    with pytest.raises(TypeError, match="default_factory"):
        @record
        class WithFactory:
            a: list = dataclasses.field(default_factory=list)

    with pytest.raises(TypeError, match="__post_init__"):
        @record
        class WithPost:
            a: int

            def __post_init__(self):
                pass


def test_a_keyword_only_record_builds_what_the_dataclass_builds():
    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class Plain:
        a: int = 1
        b: str          # required after a default: keyword-only fields allow it
        c: tuple = ()

    @record(kw_only=True)
    class Fast:
        a: int = 1
        b: str
        c: tuple = ()

    for kwargs in [{"b": "x"}, {"a": 2, "b": "y"}, {"b": "z", "c": (3,)}]:
        p, f = Plain(**kwargs), Fast(**kwargs)
        assert dataclasses.astuple(p) == dataclasses.astuple(f)
        assert repr(f).replace("Fast", "Plain") == repr(p)
        assert f == Fast(**kwargs) and hash(f) == hash(Fast(**kwargs))
    assert [p.kind for p in list(inspect.signature(Fast.__init__).parameters.values())[1:]] == \
        [inspect.Parameter.KEYWORD_ONLY] * 3
    with pytest.raises(TypeError):
        Fast(1, "x")        # positional arguments refused, as the dataclass refuses them
    with pytest.raises(TypeError):
        Fast(a=1)           # b is required
    with pytest.raises(dataclasses.FrozenInstanceError):
        Fast(b="x").a = 2


def test_a_record_refuses_mixed_keyword_only_fields():
    with pytest.raises(TypeError, match="keyword-only"):
        @record
        class Mixed:
            a: int
            b: int = dataclasses.field(default=0, kw_only=True)
