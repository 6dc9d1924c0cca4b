"""The launch prologue the SGLang launchers share (:mod:`interop.sglang`, :mod:`interop.sglang_plan`): the
context's statics and sources, int arguments, the torch path a checked launch runs on, and replay keys.

Checks raise SGLang's messages (``kv-canary: ...``; :mod:`canary_jax.contract.validation`): ``TypeError`` for a
wrong kind (``real_kv_sources`` not a sequence, a non-int argument), ``ValueError`` for bad values. Replay keys are
:mod:`interop.native.replay`'s; a key is None wherever replay does not apply, so the launch runs eagerly.
"""

from __future__ import annotations

import operator
import types
from collections.abc import Callable
from typing import Any

import jax
import torch

from canary_jax.contract import validation
from canary_jax.ops import backends, buckets
from interop import arguments, runner, sglang_types
from interop.arguments import TORCH_DTYPES
from interop.native import environ, replay
from interop.native import launch as native
from interop.sglang_types import MAX_REAL_KV_SOURCES

PLAN_BS_BLOCK_SIZE = 4096  # SGLang's _PLAN_BS_BLOCK_SIZE (Triton offsets kernel, CUDA path only)


def _statics(context: Any) -> tuple[int, int]:
    tag = validation.check_kernel_kind(context.kernel_kind)
    mode = validation.check_hash_mode(getattr(context, "real_kv_hash_mode", 0))
    return int(tag), int(mode)


def _sources(context: Any) -> tuple:
    sources = getattr(context, "real_kv_sources", ()) or ()
    if not isinstance(sources, (tuple, list)):
        raise TypeError(
            f"kv-canary: real_kv_sources must be a tuple of RealKvSource (at most {MAX_REAL_KV_SOURCES}), "
            f"got {type(sources).__name__}"
        )
    return tuple(sources)


_SOURCE_VALUES = ("page_size", "num_bytes_per_token", "read_bytes")
_STABLE = (
    sglang_types.VerifyOrWriteContext,
    sglang_types.VerifyPlan,
    sglang_types.WritePlan,
    sglang_types.RealKvSource,
)
_UNSET = object()
_SNAPSHOT_TYPES: dict[type, type] = {}


def _snapshot(obj: Any, names: tuple[str, ...]) -> Any:
    """The attributes ``names`` of ``obj`` as they are now (a missing one stays missing), in a ``SimpleNamespace``
    subclass named after ``obj``'s class, so a missing attribute's ``AttributeError`` names the caller's class as
    before, and keys tell the classes apart."""
    cls = obj.__class__
    snap = _SNAPSHOT_TYPES.get(cls)
    if snap is None:
        snap = _SNAPSHOT_TYPES.setdefault(cls, type(cls.__name__, (types.SimpleNamespace,), {"__slots__": ()}))
    return snap(**{n: v for n in names if (v := getattr(obj, n, _UNSET)) is not _UNSET})


def stable(obj: Any, names: tuple[str, ...]) -> Any:
    """``obj`` read once: ``obj`` itself where its attributes cannot change (this module's frozen launch objects),
    else a snapshot of its attributes ``names`` as they are now (:func:`_snapshot`).

    A launch keys, checks and launches the same values: an object whose attributes change between two reads (a
    property, another thread reassigning a field) must not have one value keyed and checked and another launched.
    """
    if obj.__class__ in _STABLE:
        return obj
    return _snapshot(obj, names)


def stable_context(context: Any, fields: tuple[str, ...]) -> Any:
    """:func:`stable` of a ``VerifyOrWriteContext`` (its tensors ``fields``, enums and sources, each source read once
    too): a frozen context passes as it is only with a tuple of frozen ``RealKvSource`` (it does not check what its
    ``real_kv_sources`` holds)."""
    raw = getattr(context, "real_kv_sources", None)
    if context.__class__ in _STABLE and (raw is None or (raw.__class__ is tuple and _frozen_sources(raw))):
        return context
    ctx = _snapshot(context, (*fields, "kernel_kind", "real_kv_hash_mode", "real_kv_sources"))
    raw = getattr(ctx, "real_kv_sources", None)
    if isinstance(raw, (tuple, list)):
        ctx.real_kv_sources = tuple(stable(x, ("tensor", *_SOURCE_VALUES)) for x in raw)
    return ctx


def _frozen_sources(raw: tuple) -> bool:
    for x in raw:  # a loop, not all(generator): this runs at every launch
        if x.__class__ is not sglang_types.RealKvSource:
            return False
    return True


def _int(x: Any, name: str) -> int:
    """``x`` as an int (a Python or numpy integer, or a 0-d integer tensor), else a TypeError naming ``name``."""
    try:
        return int(operator.index(x))
    except TypeError:
        raise TypeError(f"kv-canary: {name} must be an int, got {type(x).__name__}") from None


def _check_canary_buf(buf: torch.Tensor) -> None:
    validation.check_canary_buffer(arguments.facts(buf), u8=TORCH_DTYPES.u8)


CHECKED = replay.KeyMemo()
"""Launch keys (:func:`_replay_key`) whose checks passed, with the statics the checks gave: a later launch of the
key skips its checks (the key names every fact they read) and gathers its tensors unchecked."""

LAYOUTS = replay.KeyMemo()
"""The same for layout keys (``_replay_key(..., layout=True)``: no addresses), so a launch on new tensors of a
layout already checked (a prefill's fresh token tensors) skips the argument checks too; the native path still
checks its addresses (aliasing, alignment; :func:`interop.native.launch.run_native`)."""


def forget_checked(*, layouts: bool = True) -> None:
    """Forgets the launch keys whose checks passed (and, with ``layouts``, the layout keys), the native path's
    included, and the keys by address (:data:`KEYS`): the next launch of each keys and checks again. For
    benchmarks (what a launch on tensors the launchers have not seen costs: ``benchmarks/native_bench.py``,
    ``benchmarks/eager_profile.py``) and tests."""
    CHECKED.clear()
    KEYS.clear()
    if layouts:
        LAYOUTS.clear()
    native.forget_checked()


def _checked(key: Any, layout_key: Callable[[], Any], check: Callable[[], tuple]) -> tuple[Any, tuple | None, Any]:
    """A launch's statics, from :data:`CHECKED` for ``key``, else from :data:`LAYOUTS` for ``layout_key()``, else
    from ``check()`` (``(statics, ..., read_slots)``: the launcher's checks). Returns ``(statics, checked, key)``:
    ``checked`` is ``check()``'s tuple where it ran (the checked tensors), None where the launcher gathers its
    tensors unchecked; ``key`` is None where the checks read the launch's slots (checked and eager every launch).
    """
    statics = CHECKED.get(key)
    if statics is not None:
        return statics, None, key
    lkey = layout_key() if key is not None else None
    statics = LAYOUTS.get(lkey)
    checked = None
    if statics is None:
        with arguments.facts_once():
            checked = check()
        statics = checked[0]
        if checked[-1]:  # the checks read the slots: nothing memoised, nothing replayed
            return statics, checked, None
        LAYOUTS.put(lkey, statics)
    CHECKED.put(key, statics)
    return statics, checked, key


def _run(op: str, statics: Any, body_factory: Any, args: list, path: str | None, key: Any = None) -> bool:
    """Runs a checked launch on the torch path ``path`` picks (:func:`interop.native.launch.resolve_path`);
    whether it ran on the native path (a CUDA graph can then capture it). ``key``: the launch's replay key, None
    where it has none (the native path then checks and looks up its program afresh)."""
    backend = statics[0]
    if native.resolve_path(path, args[0].tensor.device, backend) == "native":
        # a default (not asked for) native path falls back to DLPack where it cannot build
        asked = path is not None or bool(environ.get(native.PATH_ENV))
        fallback = None if asked else runner.run_in_place
        return native.run_native(op, statics, body_factory, args, fallback=fallback, key=key)
    runner.run_in_place(op, statics, body_factory, args)
    return False


_RESOLVED: dict = {}  # (op, path, backend, env) -> whether the launch takes the native path (or the error)


def _native_for(op: str, path: str | None, backend: str | None, env: tuple, device: torch.device) -> bool:
    """Whether a CUDA launch with these names runs on the native path (memoised: the answer depends only on
    them); raises the resolution's ``ValueError`` for a bad name."""
    k = (op, path, backend, env)
    hit = _RESOLVED.get(k)
    if hit is None:
        try:
            b = backends.resolve_backend(backend, platform="cuda") if op != "plan" else "pallas"
            hit = native.resolve_path(path, device, b) == "native"
        except (ValueError, TypeError) as e:
            hit = (type(e), str(e))  # not the exception: its traceback would keep this launch's tensors alive
        if len(_RESOLVED) < 256:
            _RESOLVED[k] = hit
    if isinstance(hit, tuple):
        raise hit[0](hit[1])
    return hit


# What leaves a launch without a key, so that it runs eagerly and its checks raise what is wrong (RuntimeError: a
# tensor without storage).
_NO_KEY = (ValueError, TypeError, RuntimeError, replay.NotKeyable)
_IS_INFERENCE = torch.Tensor.is_inference
KEYS = replay.GuardedKeys()
"""Launch keys by address (:class:`interop.native.keys.GuardedKeys`): a launch seen before gets its key from its
tensors' addresses and one guard call on their layouts."""


def _replay_key(op: str, path: str | None, backend: str | None, first: Any, parts: Any, layout: bool = False) -> Any:
    """The launch's replay key (:func:`launch_key`), or None where replay does not apply: not CUDA tensors, not
    the native path, an argument the key cannot name, or a bad name (the checks will raise)."""
    if not isinstance(first, torch.Tensor) or not first.is_cuda:
        return None
    if first.get_device() != torch.cuda.current_device():  # replay runs on the current device's stream: eager
        return None
    try:
        env = (environ.get(native.PATH_ENV), environ.get(backends.BACKEND_ENV))
        if not _native_for(op, path, backend, env, first.device):
            return None
    except _NO_KEY:
        return None
    return launch_key(op, path, backend, env, parts, layout)


def launch_key(op: str, path: str | None, backend: str | None, env: tuple, parts: Any, layout: bool = False) -> Any:
    """The key of a launch (:mod:`interop.native.replay`) of ``op`` on the named path and backend, in environment
    ``env`` and the current torch modes, x64 and bucket policy; None where an argument cannot be keyed.

    ``parts(tkey)`` gives the launch's arguments keyed by ``tkey``: a :class:`interop.native.keys.Collector` takes
    them flat, each tensor keyed by its address, the rest of its key (:func:`interop.native.replay.tensor_key` for
    this launch's torch modes, which the key names) coming from :data:`KEYS`; with ``layout``,
    :func:`interop.native.replay.layout_key` keys each tensor: the launch's layout key, for :data:`LAYOUTS`."""
    try:
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
        # the process-wide bucket policy decides the staging copies a graph captures
        modes = (bool(jax.config.jax_enable_x64), inference, grad, buckets.default_buckets())
        if layout:
            return (op, path, backend, env, modes, parts(replay.layout_key(inference, grad)))
        args = replay.Collector()
        rest = parts(args)  # the arguments the collector does not take (flags passed as values)
        flat, tensors = args.fast()  # each tensor by its address alone
        if not inference:  # the guard reads inference-ness from dispatch keys, which a thread may exclude: name it
            flat = (flat, tuple(map(_IS_INFERENCE, tensors)))
        return KEYS.key((op, path, backend, env, modes, rest, flat), tensors, replay.tensor_key(inference, grad))
    except _NO_KEY:
        return None


def _context_key(context: Any, fields: tuple[str, ...], tkey: Any = replay.full_tensor_key) -> tuple:
    """The key of a ``VerifyOrWriteContext``: its tensors ``fields``, enums and sources. A launch whose sources
    do not cover the canary buffer reads its slots every launch (:func:`interop.arguments.check_coverage`); the
    launcher then neither memoises its checks nor replays it."""
    # _sources' TypeError (not a sequence) means no key: the eager checks then raise it
    src = tuple([replay.fields_sig(x, ("tensor",), _SOURCE_VALUES, tkey) for x in _sources(context)])
    return (replay.fields_sig(context, fields, ("kernel_kind", "real_kv_hash_mode"), tkey), src)


def _staged(before: dict, after: dict) -> list[torch.Tensor]:
    """The staging tensors :mod:`interop.padding` put in place of the caller's (a graph keeps them alive)."""
    return [t for n, t in after.items() if before.get(n) is not t]
