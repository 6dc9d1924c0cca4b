"""Replay keys: what a launch's graph, memoised checks and program depend on, as one hashable value.

A launch key (built by :func:`interop.sglang_launch._replay_key` from these pieces) names every tensor's
address, shape, strides and dtype (:func:`tensor_key`; :func:`layout_key` without the address, for the checks a
layout decides), every flag, size and enum by value (:func:`value_sig`), and the objects' classes
(:func:`fields_sig`). :class:`KeyMemo` remembers what the first launch of a key computed.

A replayed launch's host time is mostly its key (issue #26: about 0.45 us per tensor for its address, shape,
strides and dtype, and as much again for the structure around them). :class:`GuardedKeys` computes the key of a
launch it has seen from the tensors' addresses alone: the layouts of those tensors are then checked by one call
of torch's own tensor guard (``torch._C._dynamo.guards.TensorGuards``: shape, strides, dtype, device, requires
grad, dispatch keys, Python type, in C++), which is at least as strict as :func:`tensor_key`. Where torch has no
such guard, every launch computes its key in full: the same keys either way.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch

MAX_KEYS = 4096
"""The most keys a :class:`KeyMemo` or :class:`GuardedKeys` keeps (the oldest forgotten first)."""


class NotKeyable(Exception):
    """An argument the replay key cannot name (not a torch tensor, an unhashable field): launch eagerly."""


def full_tensor_key(x: torch.Tensor) -> Hashable:
    """A tensor's key in any mode: its memory (address and device), layout, dtype, and the two properties that
    decide whether torch lets the launch update it in place (inference tensor, requires grad)."""
    return (x.data_ptr(), x.shape, x.stride(), x.dtype, x.get_device(), x.is_inference(), x.requires_grad)


def _key_inference(x: torch.Tensor) -> Hashable:
    return (x.data_ptr(), x.shape, x.stride(), x.dtype)


def _key_no_grad(x: torch.Tensor) -> Hashable:
    return (x.data_ptr(), x.shape, x.stride(), x.dtype, x.is_inference())


def tensor_key(inference_mode: bool, grad_mode: bool) -> Callable[[torch.Tensor], Hashable]:
    """The cheapest tensor key for launches in these torch modes (which the launch key names): the address,
    shape, strides and dtype always; ``is_inference()`` only outside inference mode (where
    :func:`interop.native.launch.check_writable` refuses an inference tensor it would update), ``requires_grad``
    only with grad mode on. No device: CUDA's unified addressing gives every device's and the host's memory
    distinct addresses in one process, and the launch key names the canary buffer's device."""
    if inference_mode:
        return _key_inference
    return _key_no_grad if not grad_mode else full_tensor_key


def _layout_full(x: torch.Tensor) -> Hashable:
    return (x.shape, x.stride(), x.dtype, x.get_device(), x.is_inference(), x.requires_grad)


def _layout_inference(x: torch.Tensor) -> Hashable:
    return (x.shape, x.stride(), x.dtype, x.get_device())


def _layout_no_grad(x: torch.Tensor) -> Hashable:
    return (x.shape, x.stride(), x.dtype, x.get_device(), x.is_inference())


def layout_key(inference_mode: bool, grad_mode: bool) -> Callable[[torch.Tensor], Hashable]:
    """:func:`tensor_key` without the address, with the device index: the key of what a launch's argument checks
    read of a tensor (shape, strides, dtype, device; ``is_inference()`` and ``requires_grad`` as
    :func:`tensor_key` names them), so that tensors of a layout already checked skip the checks. The checks that
    read addresses (aliasing, alignment) are not memoised by it."""
    if inference_mode:
        return _layout_inference
    return _layout_no_grad if not grad_mode else _layout_full


def sig(x: Any, tkey: Callable[[torch.Tensor], Hashable] = full_tensor_key) -> Hashable:
    """The replay key of one launcher argument: a tensor by ``tkey`` (its memory and layout), a sequence item by
    item, a scalar by value.

    Raises:
      NotKeyable: anything else (a DLPack object, an unhashable value).
    """
    if isinstance(x, torch.Tensor):
        return tkey(x)
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (tuple, list)):
        return tuple([sig(v, tkey) for v in x])
    if hasattr(x, "__dlpack__") or type(x).__name__ == "PyCapsule":  # imported per launch: not a fixed tensor
        raise NotKeyable(type(x).__name__)
    try:
        hash(x)
    except TypeError:
        raise NotKeyable(type(x).__name__) from None
    return (type(x), x)


def tensors_sig(xs: Iterable[Any], tkey: Callable[[torch.Tensor], Hashable] = full_tensor_key) -> tuple | None:
    """The replay key of tensor arguments: each torch tensor by ``tkey``, None as None (with a :class:`Collector`
    for ``tkey``, None: the collector takes them).

    Raises:
      NotKeyable: anything else (a DLPack object, which a launch imports afresh; a wrong type, which the checks
        refuse); with a :class:`Collector`, from its :meth:`Collector.fast` instead.
    """
    if tkey.__class__ is Collector:
        items = tkey.items
        for x in xs:  # an optional tensor left None is common (a write's expected tokens): no item, a marker
            if x is None:
                tkey.classes.append((None, len(items)))  # where it was: (None, t) and (t, None) differ
            else:
                items.append(x)
        return None
    out = []
    inline = tkey is _key_inference  # _key_inference's key, without a call per tensor
    for x in xs:
        if inline and x.__class__ is _TENSOR:
            out.append((x.data_ptr(), x.shape, x.stride(), x.dtype))
        elif isinstance(x, torch.Tensor):
            out.append(tkey(x))
        elif x is None:
            out.append(None)
        else:
            raise NotKeyable(type(x).__name__)
    return tuple(out)


def value_sig(x: Any) -> Hashable:
    """The replay key of an argument the launch reads as a Python value (a flag, a size, an enum): by value.

    Raises:
      NotKeyable: a tensor (a 0-d tensor passed as a scalar is read at every eager launch; a graph would keep the
        value it saw at capture), or anything :func:`sig` cannot key.
    """
    if isinstance(x, (int, float, str)):  # enums of these too (a tensor is none of them)
        return (x.__class__, x)
    if isinstance(x, torch.Tensor):
        raise NotKeyable("a tensor passed as a scalar")
    if x is None or isinstance(x, (tuple, list)):
        return sig(x)
    return (type(x), sig(x))  # by type too: 8 and 8.0 are equal keys, but the checks take only the int


def fields_sig(
    obj: Any,
    fields: tuple[str, ...],
    values: tuple[str, ...] = (),
    tkey: Callable[[torch.Tensor], Hashable] = full_tensor_key,
) -> tuple | None:
    """:func:`tensors_sig` of ``obj``'s attributes ``fields`` (tensors by ``tkey``) and :func:`value_sig` of its
    attributes ``values`` (a missing one keys as a marker; the checks will raise), after ``obj``'s class; with a
    :class:`Collector` for ``tkey``, None (the collector takes them).

    Raises:
      NotKeyable: a field that is neither a torch tensor nor None, or a value :func:`value_sig` cannot key.
    """
    getter, n, single = _spec(fields, values)
    try:
        got = getter(obj)  # one C call for every attribute
        if single:  # attrgetter of one name returns the value itself
            got = (got,)
    except AttributeError:
        got = tuple([getattr(obj, f, _MISSING) for f in (*fields, *values)])
    if tkey.__class__ is Collector:
        tkey.fields(obj.__class__, got, n)
        return None
    out = [obj.__class__]
    add = out.append
    inline = tkey is _key_inference  # the serving mode, inlined: a call per tensor costs as much as its key
    i = 0
    for x in got:  # plain loops: a comprehension costs a frame, as much as two tensor keys
        if i >= n:
            add((x.__class__, x) if x.__class__ in _PLAIN else value_sig(x))
        elif x.__class__ is _TENSOR:
            add((x.data_ptr(), x.shape, x.stride(), x.dtype) if inline else tkey(x))
        else:
            add(x if x is _MISSING else tensors_sig((x,), tkey)[0])
        i += 1
    return tuple(out)


class Collector:
    """A ``tkey`` that collects a launch's arguments flat, in launch order, instead of keying them one by one:
    :func:`fields_sig` and :func:`tensors_sig` given a collector add to it and return None. :meth:`fast` is then
    the launch's key with each tensor by its address alone (a few C loops over all of them), the first half of a
    guarded key (:class:`GuardedKeys`), whose guard checks the tensors' layouts.

    A tensor argument left None is a position marker in ``classes`` (:func:`tensors_sig` looks at each argument
    anyway); a None tensor attribute of a launch object stays in ``items`` and :meth:`fast` keys it as None in its
    fallback loop, where the one C loop over ``items`` fails. Scanning each object's fields for None first would
    give one encoding but costs every launch: ``None in fields`` calls torch's ``__eq__`` per tensor, and even an
    identity scan (``map(operator.is_not, ...)``) adds a pass per object (three per write launch), where the
    common all-tensor path now pays nothing."""

    __slots__ = ("items", "classes", "values")

    def __init__(self):
        self.items: list = []  # tensor fields in order: tensors (and a field's None or missing marker)
        self.classes: list = []  # objects' classes, and (None, position in items) of a tensor argument left None
        self.values: list = []

    def __call__(self, x: torch.Tensor) -> None:  # as a plain tkey (sig): the tensor is collected
        self.items.append(x)

    def fields(self, cls: type, got: tuple, n: int) -> None:
        self.classes.append(cls)
        self.items.extend(got[:n])
        self.values.extend(got[n:])

    def fast(self) -> tuple[Hashable, list[torch.Tensor]]:
        """``(key, tensors)``: the key names each tensor field by its address (None and missing ones as
        themselves), each value by type and value, each object by class; ``tensors`` are the tensors, in order.

        Raises:
          NotKeyable: a tensor field that is neither a torch tensor nor None, or a value :func:`value_sig` cannot
            key.
        """
        items = self.items
        try:
            ptrs = tuple(map(_DATA_PTR, items))  # one C loop where every field is a tensor
            tensors = items
        except TypeError:  # None, a missing field (keyed as a marker: the checks raise) or a wrong type
            ptrs = tuple([x if x is None or x is _MISSING else _address(x) for x in items])
            tensors = [x for x in items if isinstance(x, torch.Tensor)]
        vals = tuple(self.values)
        types = tuple(map(type, vals))
        if not _VALUE_TYPES.issuperset(types) and not _learn_value_types(types):  # beyond ints, floats, str
            return (tuple(self.classes), ptrs, tuple([value_sig(x) for x in vals])), tensors  # no raw objects
        return (tuple(self.classes), ptrs, types, vals), tensors


def _address(x: Any) -> int:
    if not isinstance(x, torch.Tensor):
        raise NotKeyable(type(x).__name__)
    return x.data_ptr()


def _learn_value_types(types: tuple[type, ...]) -> bool:
    """Whether every class of ``types`` keys by value (an int, float or str, or a subclass such as an enum, as
    :func:`value_sig` keys them), remembering the new ones."""
    new = [t for t in types if t not in _VALUE_TYPES]
    if not all(issubclass(t, (int, float, str)) for t in new):  # (no class is both one of these and a tensor)
        return False
    if len(_VALUE_TYPES) < 256:
        _VALUE_TYPES.update(new)
    return True


_PLAIN = frozenset({int, bool, float, str})
_VALUE_TYPES = set(_PLAIN)  # and the enums of these seen so far: a value of these types keys by type and value


_TENSOR = torch.Tensor
_DATA_PTR = torch.Tensor.data_ptr


@functools.cache
def _spec(fields: tuple[str, ...], values: tuple[str, ...]) -> tuple[Callable[[Any], Any], int, bool]:
    return operator.attrgetter(*fields, *values), len(fields), len(fields) + len(values) == 1


_MISSING = ("<missing>",)


class KeyMemo:
    """What the first launch of a key computed (its checks passed, its statics, its program), so that later
    launches of the key skip that work: the key names everything it depended on. At most ``cap`` keys, the
    oldest forgotten first; a None key is never stored."""

    def __init__(self, cap: int = MAX_KEYS):
        self._d: dict[Hashable, Any] = {}
        self._cap = cap

    def get(self, key: Hashable | None) -> Any:
        return None if key is None else self._d.get(key)

    def put(self, key: Hashable | None, value: Any) -> None:
        if key is None:
            return
        d = self._d
        if key not in d and len(d) >= self._cap:
            try:
                d.pop(next(iter(d)), None)
            except (RuntimeError, StopIteration):  # another thread changed it meanwhile: forget one next time
                pass
        d[key] = value

    def clear(self) -> None:
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)


class LaunchKey:
    """A launch key (a tuple of hashable parts) that hashes once: the launchers look a key up in several tables
    (its graph, its checks, its program), and hashing the whole tuple again costs about a microsecond each. Equal
    to another :class:`LaunchKey` of equal parts."""

    __slots__ = ("parts", "_hash")

    def __init__(self, parts: tuple):
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            other.__class__ is LaunchKey and self._hash == other._hash and self.parts == other.parts
        )

    def __repr__(self) -> str:
        return f"LaunchKey{self.parts!r}"


def _tensor_guard(tensors: list[torch.Tensor]) -> Any:
    """torch's C++ guard of these tensors' layouts (shape, strides, dtype, device, requires grad, dispatch keys,
    Python type; not their addresses), or None where this torch has none or cannot build one."""
    global _GUARD_TYPE
    if _GUARD_TYPE is None:
        try:
            from torch._C._dynamo.guards import TensorGuards as _GUARD_TYPE
        except ImportError:  # a private API: without it, keys are computed in full
            _GUARD_TYPE = False
    if _GUARD_TYPE is False:
        return None
    try:
        return _GUARD_TYPE(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    except Exception:  # noqa: BLE001 - a signature this torch does not take, a tensor it cannot guard
        return None


_GUARD_TYPE: Any = None  # torch's TensorGuards class once looked up, False where torch has none


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` with each object once, in order (a launch may pass one tensor as two arguments)."""
    return list({id(t): t for t in tensors}.values())


_PENDING = object()  # a key seen once: its guard is built at its second sighting


class GuardedKeys:
    """Launch keys by address: a launch seen before gets its full key back from its tensors' addresses and the
    rest of its arguments (``fast``: the key with each tensor by :class:`Collector`), once one guard call has
    checked that its tensors' layouts are the ones the full key was built from. ``key(fast, tensors, tkey)``
    returns the :class:`LaunchKey` of ``(fast, (tkey(t) for t in tensors))``, which a miss (a new address, a
    changed layout) computes in full and remembers; a hit returns the same object. The guard is built at a key's
    second sighting, so launches on fresh tensors every time (a prefill's) pay for no guard; a guard that refuses
    the layouts it was built from leaves its key compared in full (the same object still returned). At most
    :data:`MAX_KEYS` keys, the oldest forgotten first.
    """

    def __init__(self):
        self._memo = KeyMemo()
        self.guarded = 0  # keys returned by a guard's check (for tests and benchmarks)

    def key(self, fast: Hashable, tensors: list[torch.Tensor], tkey: Callable[[torch.Tensor], Hashable]) -> LaunchKey:
        hit = self._memo.get(fast)
        if hit is None:
            parts = (fast, tuple([tkey(t) for t in tensors]))
        else:
            guard, known, dedupe = hit
            if guard is not None and guard is not _PENDING:
                try:
                    ok = guard.check(*(_unique(tensors) if dedupe else tensors))
                except Exception:  # noqa: BLE001 - a tensor the guard cannot read: key it in full
                    ok = False
                if ok:
                    self.guarded += 1
                    return known
            parts = (fast, tuple([tkey(t) for t in tensors]))
            if known.parts == parts:
                if guard is _PENDING:  # seen twice: worth a guard (one argument per tensor object: torch's
                    uniq = _unique(tensors)  # guard refuses the same object in two places)
                    self._memo.put(fast, (_tensor_guard(uniq), known, len(uniq) < len(tensors)))
                elif guard is not None:  # it refused the layouts it was built from: compare in full from now on
                    self._memo.put(fast, (None, known, False))
                return known
        full = LaunchKey(parts)  # first seen (launches on fresh tensors every time never build a guard)
        self._memo.put(fast, (_PENDING, full, False))
        return full

    def clear(self) -> None:
        self._memo.clear()
