"""The buffers of one torch launch: how each torch argument is imported into JAX and written back.

Every tensor is imported zero-copy (:mod:`interop.dlpack`): int64 tensors as ``int32[..., 2]`` pairs (read as
``uint32[..., 2]`` inside the program), other tensors as they are. One-element tensors (counters, write index,
flags, ``num_valid``) go through a *byte window*: the aligned span of their storage that ends at the element
(SGLang passes counters as ``counters[tag:tag+1]`` views whose pointers are only 8-byte aligned, and XLA:CPU
needs 64); windows of one storage that overlap are merged. Imports are cached in one process-wide
:class:`~interop.dlpack.ImportCache` (:func:`import_cache`).

:func:`plan_buffers` decides the buffers, :func:`import_buffer` imports one, and inside the jitted program
:func:`unpack` / :func:`pack` turn buffers into the body's named values and back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch

from interop import dlpack

__all__ = [
    "Buffer",
    "Member",
    "TensorArg",
    "check_device_and_aliasing",
    "import_buffer",
    "import_cache",
    "pack",
    "plan_buffers",
    "unpack",
]

_CACHE = dlpack.ImportCache()


def import_cache() -> dlpack.ImportCache:
    """The process-wide import cache used by the launchers."""
    return _CACHE


@dataclasses.dataclass(slots=True, eq=False)  # not frozen: a frozen dataclass costs 3x to build, a dozen a launch
class TensorArg:
    """One torch argument of a launch (read-only by convention; compared and hashed by identity).

    Fields:
      name: argument name (error messages and the body's dict key).
      tensor: the torch tensor, already dtype/shape-checked by the caller.
      mutable: the launch writes it (in place).
      owner: the caller's tensor when ``tensor`` is a view made for this call (e.g. ``.view(torch.uint8)``),
        so cached imports live as long as the caller's tensor; defaults to ``tensor``.
    """

    name: str
    tensor: torch.Tensor
    mutable: bool = False
    owner: Any = None  # the caller's long-lived tensor ``tensor`` is a view of (keys the import cache)


@dataclasses.dataclass(frozen=True, slots=True)
class Member:
    """One torch argument inside a buffer: its byte range, logical shape and kind."""

    name: str
    offset: int  # byte offset inside the window
    nbytes: int
    shape: tuple[int, ...]
    kind: str  # "i64" | "i32" | "raw"
    dtype: str
    mutable: bool


@dataclasses.dataclass
class Buffer:
    """One imported JAX argument of the launch program: a whole tensor, or a byte window of scalars."""

    view: torch.Tensor  # what is imported (pairs view / canary buffer / byte window)
    members: list[Member]
    window: bool
    owners: list  # weak references to the caller's tensors (never strong: see ImportCache)
    key: Hashable
    mutable: bool
    source: torch.Tensor | None = None  # staged copy: the caller's data, copied into ``view`` before each launch


def _kind(t: torch.Tensor) -> str:
    if t.dtype in (torch.int64, torch.uint64):
        return "i64"
    if t.dtype == torch.int32:
        return "i32"
    return "raw"


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    lo = t.data_ptr()
    return lo, lo + t.numel() * t.element_size()


def check_device_and_aliasing(args: Sequence[TensorArg]) -> torch.device:
    first = args[0]
    dev = first.tensor.device
    for a in args[1:]:
        if a.tensor.device != dev:
            raise ValueError(
                f"kv-canary: {a.name} is on {a.tensor.device} but {first.name} is on {dev}; all tensors of one "
                "launch must be on the same device"
            )
    spans = [(a, _byte_range(a.tensor)) for a in args if a.tensor.numel() > 0]
    for i, (a, (alo, ahi)) in enumerate(spans):
        for b, (blo, bhi) in spans[i + 1 :]:
            if (a.mutable or b.mutable) and alo < bhi and blo < ahi:
                w, o = (a, b) if a.mutable else (b, a)
                raise ValueError(
                    f"kv-canary: {w.name} overlaps {o.name} in memory; an output of the launch must not alias "
                    "another argument"
                )
    return dev


def _misaligned(a: TensorArg, view: torch.Tensor, dev: torch.device, align: int) -> ValueError:
    msg = dlpack.misaligned_message(view, a.name, align, dtype=a.tensor.dtype)
    if a.mutable:
        why = "it is an output of the launch, updated in place, so it is never copied (a copy would hide the update)"
    else:
        why = f"read-only inputs are copied only on CPU, this one is on {dev}"
    return ValueError(f"{msg}; {why}: pass an aligned tensor (e.g. a fresh allocation or .clone())")


def _whole(a: TensorArg, dev: torch.device, align: int) -> Buffer:
    """One tensor as its own buffer; a misaligned read-only CPU tensor is staged in an aligned copy."""
    t = a.tensor
    kind = _kind(t)
    view = dlpack.int64_pairs_view(t, a.name) if kind == "i64" else dlpack.contiguous_view(t, a.name)
    source = None
    if t.numel() > 0 and view.data_ptr() % align:
        if a.mutable or dev.type != "cpu":
            raise _misaligned(a, view, dev, align)
        source, view = view, torch.empty_like(view, memory_format=torch.contiguous_format)  # torch CPU: 64-aligned
    m = Member(a.name, 0, t.numel() * t.element_size(), tuple(t.shape), kind, str(t.dtype), a.mutable)
    owner = a.owner if a.owner is not None else t
    return Buffer(view, [m], False, [_CACHE.ref(owner)], dlpack.ImportCache.key_for(view), a.mutable, source)


def plan_buffers(args: Sequence[TensorArg], dev: torch.device) -> list[Buffer]:
    """The buffers of a launch (see the module docstring).

    On CPU, a read-only tensor whose data pointer XLA cannot import (``torch.from_numpy`` arrays and offset
    views are often only 16-byte aligned, XLA:CPU needs 64) is staged: an aligned copy refreshed from the
    tensor before every launch (:attr:`Buffer.source`). Mutable tensors are never staged.

    Raises:
      ValueError: a misaligned mutable tensor (or any misaligned tensor off CPU), naming it and why.
    """
    align = dlpack.device_alignment(dev)
    buffers: list[Buffer] = []
    scalars_by_storage: dict[int, list[TensorArg]] = {}
    for a in args:
        t = a.tensor
        if t.numel() == 1 and t.element_size() in (4, 8) and _kind(t) != "raw":
            scalars_by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(a)
            continue
        buffers.append(_whole(a, dev, align))
    for base, group in scalars_by_storage.items():
        spans = []
        for a in group:
            p = a.tensor.data_ptr()
            start = max(base, p - p % align)
            spans.append((start, p + a.tensor.element_size(), a))
        spans.sort(key=lambda s: s[0])
        merged: list[list] = []
        for s in spans:
            if merged and s[0] < merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], s[1])
                merged[-1][2].append(s[2])
            else:
                merged.append([s[0], s[1], [s[2]]])
        storage = group[0].tensor.untyped_storage()
        for start, end, members in merged:
            if start % align:
                if dev.type == "cpu" and not any(m.mutable for m in members):
                    buffers.extend(_whole(m, dev, align) for m in members)  # staged aligned copies
                    continue
                names = ", ".join(m.name for m in members)
                why = (
                    "it is an output of the launch, updated in place, so it is never copied (a copy would hide "
                    "the update)"
                    if any(m.mutable for m in members)
                    else f"read-only inputs are copied only on CPU, this one is on {dev}"
                )
                raise ValueError(
                    f"kv-canary: {names} lives in a storage whose base 0x{base:x} is not aligned to {align} bytes; "
                    f"XLA cannot import it without a copy, and {why}"
                )
            view = torch.empty(0, dtype=torch.uint8, device=dev).set_(storage, start - base, (end - start,), (1,))
            mems = [
                Member(
                    m.name,
                    m.tensor.data_ptr() - start,
                    m.tensor.element_size(),
                    tuple(m.tensor.shape),
                    _kind(m.tensor),
                    str(m.tensor.dtype),
                    m.mutable,
                )
                for m in members
            ]
            buffers.append(
                Buffer(
                    view,
                    mems,
                    True,
                    [_CACHE.ref(m.owner if m.owner is not None else m.tensor) for m in members],
                    ("win", str(dev), start, end - start),
                    any(m.mutable for m in members),
                )
            )
    # A donated window rewrites its padding bytes: refuse if they belong to another mutable argument.
    for b in buffers:
        if not (b.window and b.mutable):
            continue
        lo, hi = b.view.data_ptr(), b.view.data_ptr() + b.view.numel()
        mine = {m.name for m in b.members}
        for a in args:
            if a.name in mine or not a.mutable or a.tensor.numel() == 0:
                continue
            alo, ahi = _byte_range(a.tensor)
            if alo < hi and lo < ahi:
                raise ValueError(
                    f"kv-canary: {sorted(mine)[0]} shares an aligned {hi - lo}-byte span with the output {a.name}; "
                    "allocate them apart"
                )
    return buffers


def import_buffer(b: Buffer) -> jax.Array:
    """The JAX array of ``b`` (cached; a staged copy is refreshed from the caller's tensor first)."""
    if b.source is not None:
        b.view.copy_(b.source)  # the staged copy: the caller's current bytes
    hit = _CACHE.get(b.key)
    if hit is not None:
        return hit
    m = b.members[0]
    arr = dlpack._import_exact(b.view, name=m.name, dtype=getattr(torch, m.dtype.replace("torch.", "")))
    _CACHE.put(b.key, arr, b.owners)
    return arr


# --- inside the jitted program ---------------------------------------------------------------------------
def unpack(buf: jax.Array, spec: tuple, vals: dict) -> None:
    window, members = spec
    if not window:
        (m,) = members
        vals[m.name] = jax.lax.bitcast_convert_type(buf, jnp.uint32) if m.kind == "i64" else buf
        return
    for m in members:
        seg = jax.lax.slice(buf, (m.offset,), (m.offset + m.nbytes,))
        if m.kind == "i64":
            v = jax.lax.bitcast_convert_type(seg.reshape(2, 4), jnp.uint32).reshape(m.shape + (2,))
        else:
            v = jax.lax.bitcast_convert_type(seg.reshape(1, 4), jnp.dtype(m.dtype.replace("torch.", ""))).reshape(
                m.shape
            )
        vals[m.name] = v


def pack(buf: jax.Array, spec: tuple, new: dict) -> jax.Array:
    window, members = spec
    if not window:
        (m,) = members
        out = new[m.name]
        if m.kind == "i64":
            out = jax.lax.bitcast_convert_type(out.astype(jnp.uint32), jnp.int32)
        if out.shape != buf.shape or out.dtype != buf.dtype:
            raise TypeError(
                f"kv-canary: body returned {out.dtype}{out.shape} for {m.name}, want {buf.dtype}{buf.shape}"
            )
        return out
    out = buf
    for m in members:
        if not m.mutable:
            continue
        v = new[m.name]
        b = jax.lax.bitcast_convert_type(v.reshape(-1), jnp.uint8).reshape(m.nbytes)
        out = jax.lax.dynamic_update_slice(out, b, (m.offset,))
    return out
