"""Launch keys by address (issue #26: a replayed launch's host time is mostly its key).

:func:`interop.sglang_launch.launch_key` collects a launch's arguments flat (:class:`interop.native.keys.Collector`)
and gets the full key of a launch it has seen from the tensors' addresses, once torch's tensor guard has checked
their layouts (:class:`interop.native.keys.GuardedKeys`). These tests pin that the key is the full key either way:
equal where every tensor's address, shape, strides, dtype (and the mode's flags) and every value are equal, and
different where any of them differs, with and without the guard.
"""

from __future__ import annotations

import enum
import gc
import types
import weakref

import pytest
import torch

from interop import sglang_launch
from interop.native import keys, replay

FIELDS = ("a", "b", "c")
VALUES = ("n",)


class Obj(types.SimpleNamespace):
    pass


class Kind(enum.IntEnum):
    ONE = 1


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(sglang_launch, "KEYS", keys.GuardedKeys())
    return sglang_launch


def _key(obj, flag=False, extra=()):
    def parts(k):
        return (replay.fields_sig(obj, FIELDS, VALUES, k), replay.tensors_sig(extra, k), replay.value_sig(flag))

    return sglang_launch.launch_key("verify", "native", None, (), parts)


def _obj(**kw):
    t = dict(a=torch.zeros(16, dtype=torch.int64), b=torch.zeros(4, 8, dtype=torch.uint8), c=None, n=3)
    t.update(kw)
    return Obj(**t)


def _full(obj, flag=False, extra=()):
    """The key computed in full: every tensor by tensor_key, in the collector's order (fields, then extra)."""
    tk = replay.tensor_key(torch.is_inference_mode_enabled(), torch.is_grad_enabled())
    ts = [x for x in (obj.a, obj.b, obj.c, *extra) if isinstance(x, torch.Tensor)]
    return tuple(tk(t) for t in ts)


def test_a_seen_launch_gets_the_same_key_from_its_addresses(fresh):
    o = _obj()
    k1 = _key(o)
    assert isinstance(k1, keys.LaunchKey) and fresh.KEYS.guarded == 0
    assert k1.parts[1] == _full(o)  # the full key: each tensor's address, shape, strides, dtype and flags
    assert _key(o) is k1 and fresh.KEYS.guarded == 0  # the second sighting, compared in full, builds the guard
    assert _key(o) is k1 and fresh.KEYS.guarded == 1  # then: one guard call, no key built
    assert _key(Obj(**vars(o))) is k1 and fresh.KEYS.guarded == 2  # another object, same tensors and values


def test_a_layout_change_at_the_same_address_is_another_key(fresh):
    o = _obj()
    k = _key(o)
    for b in (
        o.b.view(8, 4),  # shape
        o.b.view(torch.int8),  # dtype
        o.b.as_strided((4, 8), (1, 4)),  # strides
        o.b[:2],  # shape, same first byte
    ):
        assert b.data_ptr() == o.b.data_ptr()
        for _ in range(3):  # seen three times: the guard of o's layouts is built and passes
            assert _key(o) == k
        n = fresh.KEYS.guarded
        assert n >= 1
        k2 = _key(_obj(a=o.a, b=b))  # the same addresses: the guard refuses, the key is built in full
        assert k2 != k and k2.parts[1] == _full(_obj(a=o.a, b=b)) and fresh.KEYS.guarded == n
        assert _key(_obj(a=o.a, b=b)) is k2  # compared in full at its second sighting


def test_addresses_values_and_flags_are_named(fresh):
    o = _obj()
    k = _key(o)
    assert _key(_obj(a=o.a.clone(), b=o.b)) != k
    assert _key(_obj(a=o.a, b=o.b, c=o.a)) != k  # None vs a tensor
    assert _key(_obj(a=o.a, b=o.b, n=4)) != k
    assert _key(_obj(a=o.a, b=o.b, n=3.0)) != k  # equal values of another type
    assert _key(_obj(a=o.a, b=o.b, n=Kind.ONE)) != _key(_obj(a=o.a, b=o.b, n=1))  # an enum by its class
    assert _key(o, flag=True) != k
    assert _key(o, extra=(o.a,)) != k
    assert _key(o, extra=(o.a, None)) != _key(o, extra=(None, o.a))  # where an optional tensor is left None
    assert _key(o, extra=(None, o.a)) == _key(o, extra=(None, o.a)) != _key(o, extra=(o.a,))
    assert _key(Obj(a=o.a, b=o.b, n=3)) != k  # a missing field keys as a marker (the checks will raise)
    assert _key(o) == k


def test_torch_modes_and_tensor_flags_are_named(fresh):
    o = _obj(a=torch.zeros(16, requires_grad=True))
    k = _key(o)
    assert _key(_obj(a=o.a.detach(), b=o.b)) != k  # requires_grad, same address and layout
    with torch.no_grad():
        assert _key(o) != k
    with torch.inference_mode():
        ki = _key(o)
        assert ki != k and _key(o) is ki
        inf = _obj(a=torch.zeros(16), b=torch.zeros(4, 8, dtype=torch.uint8))
        assert _key(inf) is _key(inf)
    assert _key(o) == k


def test_what_cannot_be_keyed_gives_no_key(fresh):
    o = _obj()
    assert _key(_obj(a=o.a, b=o.b, n=torch.tensor(3))) is None  # a 0-d tensor as a value: read every launch
    assert _key(_obj(a=[1, 2], b=o.b)) is None  # not a tensor
    assert _key(_obj(a=o.a, b=o.b, n={})) is None  # unhashable


def test_a_tensor_in_a_value_is_keyed_not_kept(fresh):
    t = torch.zeros(3)
    refs = [weakref.ref(t)]
    o = _obj(n=(t,))
    assert _key(o) is not None
    del o, t
    assert _all_freed(refs)


def test_an_inference_tensor_at_a_normal_one_s_address_is_another_key(fresh):
    """Outside inference mode the key names each tensor's inference-ness (the launch checks that it may update
    it), even where the thread has autograd's dispatch keys switched off and the guard could not tell."""
    import numpy as np

    arr = np.zeros(16, dtype=np.int64)
    normal = torch.from_numpy(arr)
    with torch.inference_mode():
        inf = torch.from_numpy(arr)  # the same memory
    assert inf.data_ptr() == normal.data_ptr()
    o = _obj()
    with torch._C._AutoDispatchBelowADInplaceOrView():
        for _ in range(3):
            k = _key(_obj(a=normal, b=o.b))
        k2 = _key(_obj(a=inf, b=o.b))
    assert k2 != k and k2.parts[1] == _full(_obj(a=inf, b=o.b))


def test_without_torch_s_guard_every_key_is_built_in_full(fresh, monkeypatch):
    o = _obj()
    guarded = _key(o)
    monkeypatch.setattr(sglang_launch, "KEYS", keys.GuardedKeys())
    monkeypatch.setattr(keys, "_tensor_guard", lambda tensors: None)
    k1, k2, k3 = _key(o), _key(o), _key(o)
    assert k1 == guarded and k3 is k2 is k1 and sglang_launch.KEYS.guarded == 0  # compared in full each time
    assert _key(_obj(a=o.a, b=o.b.view(8, 4))) != k1


def test_torch_s_guard_is_there():
    """The guard this module relies on for speed exists in the torch we pin (a new torch without it would make
    every key a full one: the same keys, slower)."""
    t = torch.zeros(3)
    g = keys._tensor_guard([t])
    assert g is not None and g.check(t) and not g.check(torch.zeros(4)) and not g.check(torch.zeros(3).int())


def test_launch_key_hashes_once_and_compares_by_parts():
    a, b = keys.LaunchKey((1, (2, 3))), keys.LaunchKey((1, (2, 3)))
    assert a == b and hash(a) == hash(b) == hash((1, (2, 3)))
    assert a != keys.LaunchKey((1, (2, 4))) and a != (1, (2, 3))
    assert {a: 1}[b] == 1


def test_keys_keep_no_tensor_alive(fresh):
    o = _obj()
    refs = [weakref.ref(o.a), weakref.ref(o.b)]
    assert _key(o) is not None and _key(o) is not None
    del o
    assert _all_freed(refs)


def _all_freed(refs: list) -> bool:
    gc.collect()
    return all(r() is None for r in refs)


def test_one_tensor_in_two_arguments_is_guarded_too(fresh):
    """torch's guard refuses one tensor object passed twice; the key guards each object once, so such a launch
    still gets its key from its addresses (and another layout in either place is still another key)."""
    o = _obj()
    k = _key(o, extra=(o.a,))
    assert _key(o, extra=(o.a,)) is k  # the second sighting builds the guard
    n = fresh.KEYS.guarded
    assert _key(o, extra=(o.a,)) is k and fresh.KEYS.guarded == n + 1
    assert _key(o, extra=(o.a.view(4, 4),)) != k


def test_a_guard_that_refuses_its_own_layouts_leaves_the_key_compared_in_full(fresh, monkeypatch):
    class Refuses:
        def check(self, *tensors):
            return False

    monkeypatch.setattr(keys, "_tensor_guard", lambda tensors: Refuses())
    o = _obj()
    k = _key(o)
    assert _key(o) is k and _key(o) is k and _key(o) is k and fresh.KEYS.guarded == 0
    assert _key(_obj(a=o.a, b=o.b.view(8, 4))) != k
