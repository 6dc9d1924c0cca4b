"""The launch prologue the SGLang launchers share (:mod:`interop.sglang`, :mod:`interop.sglang_plan`): the
context's statics and sources, int arguments, the torch path a checked launch runs on, and replay keys.

Checks raise SGLang's messages (``kv-canary: ...``; :mod:`canary_jax.contract.validation`): ``TypeError`` for a
wrong kind (``real_kv_sources`` not a sequence, a non-int argument), ``ValueError`` for bad values. Replay keys are
:mod:`interop.native.replay`'s; a key is None wherever replay does not apply, so the launch runs eagerly.
"""

from __future__ import annotations

import operator
import os
from typing import Any

import jax
import torch

from canary_jax.contract import validation
from canary_jax.ops import backends, buckets
from interop import arguments, runner
from interop.arguments import TORCH_DTYPES
from interop.native import launch as native
from interop.native import replay
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


def _int(x: Any, name: str) -> int:
    """``x`` as an int (a Python or numpy integer, or a 0-d integer tensor), else a TypeError naming ``name``."""
    try:
        return int(operator.index(x))
    except TypeError:
        raise TypeError(f"kv-canary: {name} must be an int, got {type(x).__name__}") from None


def _check_canary_buf(buf: torch.Tensor) -> None:
    validation.check_canary_buffer(arguments.facts(buf), u8=TORCH_DTYPES.u8)


def _run(op: str, statics: Any, body_factory: Any, args: list, path: str | None) -> bool:
    """Runs a checked launch on the torch path ``path`` picks (:func:`interop.native.launch.resolve_path`);
    whether it ran on the native path (a CUDA graph can then capture it)."""
    backend = statics[0]
    if native.resolve_path(path, args[0].tensor.device, backend) == "native":
        # a default (not asked for) native path falls back to DLPack where it cannot build
        asked = path is not None or bool(os.environ.get(native.PATH_ENV))
        return native.run_native(op, statics, body_factory, args, fallback=None if asked else runner.run_in_place)
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
            hit = e
        if len(_RESOLVED) < 256:
            _RESOLVED[k] = hit
    if isinstance(hit, Exception):
        raise hit
    return hit


def _replay_key(op: str, path: str | None, backend: str | None, first: Any, parts: Any) -> tuple | None:
    """The launch's replay key (:mod:`interop.native.replay`), or None where replay does not apply: not CUDA
    tensors, not the native path, an argument the key cannot name, or a bad name (the checks will raise).
    ``parts(tkey)`` gives the launch's arguments already keyed, tensors by ``tkey``
    (:func:`interop.native.replay.tensor_key` for this launch's torch modes, which the key names); it is called
    only where replay applies."""
    if not isinstance(first, torch.Tensor) or not first.is_cuda:
        return None
    if first.get_device() != torch.cuda.current_device():  # replay runs on the current device's stream: eager
        return None
    try:
        env = (os.environ.get(native.PATH_ENV), os.environ.get(backends.BACKEND_ENV))
        if not _native_for(op, path, backend, env, first.device):
            return None
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
        # the process-wide bucket policy decides the staging copies a graph captures
        modes = (bool(jax.config.jax_enable_x64), inference, grad, buckets.default_buckets())
        return (op, path, backend, env, modes, parts(replay.tensor_key(inference, grad)))
    except (ValueError, TypeError, replay.NotKeyable):
        return None


def _context_key(context: Any, fields: tuple[str, ...], tkey: Any = replay.full_tensor_key) -> tuple:
    # _sources' TypeError (not a sequence) means no key: the eager checks then raise it
    srcs = _sources(context)
    if srcs and _int(getattr(context, "real_kv_hash_mode", 0), "real_kv_hash_mode") != 0:
        # a source shorter than the canary buffer is checked against the launch's slots, read every launch: eager
        n = getattr(getattr(context, "canary_buf", None), "shape", (0,))[0]
        for x in srcs:
            t = getattr(x, "tensor", None)
            if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] * _int(x.page_size, "page_size") < n:
                raise replay.NotKeyable("real_kv_sources")
    src = tuple([replay.fields_sig(x, ("tensor",), _SOURCE_VALUES, tkey) for x in srcs])
    return (replay.fields_sig(context, fields, ("kernel_kind", "real_kv_hash_mode"), tkey), src)


_SOURCE_VALUES = ("page_size", "num_bytes_per_token", "read_bytes")


def _staged(before: dict, after: dict) -> list[torch.Tensor]:
    """The staging tensors :mod:`interop.padding` put in place of the caller's (a graph keeps them alive)."""
    return [t for n, t in after.items() if before.get(n) is not t]
