"""Run a jitted JAX function on torch tensors, updating the mutable ones in place.

:func:`run_in_place` is the one mechanism every torch-facing launcher uses:

1. **Checks** (before anything is imported or run, so a refused call leaves every tensor untouched): one
   device for all tensors; no mutable tensor overlapping any other argument's bytes.
2. **Zero-copy import** of every tensor (:mod:`interop.dlpack`): int64 tensors as ``int32[..., 2]`` pairs;
   one-element tensors (counters, write index, flags, ``num_valid``) through a *byte window*: the aligned span
   of their storage that ends at the element (SGLang passes counters as ``counters[tag:tag+1]`` views whose
   pointers are only 8-byte aligned, and XLA:CPU needs 64). Imports are cached (:class:`~interop.dlpack.ImportCache`).
3. **Stream order** on CUDA: a fresh import of a small fence tensor per call makes the JAX computation wait
   for everything torch's current stream had queued (the DLPack stream handshake), and a
   ``torch.from_dlpack`` of an output makes torch's current stream wait for the JAX computation.
4. **One jitted call** per (op, statics, layout), cached; shapes and dtypes key jit's own cache, so a
   steady-state launch never re-traces (:func:`trace_count` lets tests pin that).
5. **In place**: mutable buffers are donated where the platform hands a donated imported buffer back as the
   output (measured once per device type by :func:`donation_aliases`; true on our H200, false on XLA:CPU
   with jax 0.10.2). The first launch of each compiled program checks every output by pointer: if it is
   the torch memory, nothing is copied and the output becomes the cached import for the next call;
   otherwise it is copied back with ``torch.copy_`` - the whole array for ordinary buffers (the canary
   buffer costs O(num_slots) then), only the element bytes for windowed scalars. Later launches reuse that
   decision without asking for pointers (see :func:`set_alias_check` for why), and re-check every
   ``ALIAS_RECHECK_PERIOD``-th launch.

The body sees a dict ``name -> jax.Array`` (int64 arguments as ``uint32[..., 2]``, everything else in its
torch dtype and shape) and returns a dict with a new value, of the same shape and dtype, for every mutable
name.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
import warnings
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import torch

from interop import dlpack

__all__ = [
    "TensorArg",
    "donation_aliases",
    "import_cache",
    "alias_check_count",
    "last_launch_program",
    "last_launch_report",
    "phase_times",
    "run_in_place",
    "set_alias_check",
    "set_phase_timing",
    "set_stream_sync",
    "stream_sync",
    "trace_count",
]

_CACHE = dlpack.ImportCache()
_TRACES = [0]
_LAST_REPORT: dict[str, Any] = {}
_STREAM_SYNC = ["fence"]
_ALIAS_CHECK = ["first"]
_ALIAS_CHECKS = [0]  # pointer queries of launch outputs made by run_in_place (tests pin steady state)
ALIAS_RECHECK_PERIOD = 1024  # launches of one prepared program between two pointer re-checks
_PHASES: dict[str, list] = {}  # name -> [count, seconds] while phase timing is on
_TIMING = [False]


def import_cache() -> dlpack.ImportCache:
    """The process-wide import cache used by the launchers."""
    return _CACHE


def trace_count() -> int:
    """Number of times a launcher's JAX function has been traced in this process."""
    return _TRACES[0]


def set_stream_sync(mode: str) -> None:
    """CUDA ordering between torch's current stream and JAX: ``"fence"`` (default, asynchronous DLPack
    handshakes), ``"host"`` (synchronise torch's current stream before and block on JAX's result after; slow,
    for debugging), or ``"none"`` (caller orders the streams; unsafe)."""
    if mode not in ("fence", "host", "none"):
        raise ValueError(f"kv-canary: stream sync mode must be 'fence', 'host' or 'none', got {mode!r}")
    _STREAM_SYNC[0] = mode


def stream_sync() -> str:
    return _STREAM_SYNC[0]


def set_alias_check(mode: str) -> None:
    """When launches ask the runtime for their outputs' buffer pointers: ``"first"`` (default) or ``"every"``.

    Asking is not free: an output's pointer (``unsafe_buffer_pointer``, an external reference in PJRT) is
    only known once the runtime has dispatched the computation, so a per-launch query makes the host wait
    for every launch (XLA's TFRT GPU client blocks ``AcquireExternalReference`` on the buffer's definition
    event). Whether a donated input comes back as the output is fixed by the compiled program (its
    input/output aliases), and a donation that cannot happen fails at dispatch, so the first launch of each
    compiled program decides and later launches (any tensors of the same layout) reuse the decision,
    re-checked every ``ALIAS_RECHECK_PERIOD``-th launch: an output found not aliased then is copied back (the
    launches in between kept their results in the cached output, so nothing is lost) and that program
    switches to ``"every"`` with a warning. ``"every"`` checks each launch (debugging; the old behaviour).
    """
    if mode not in ("first", "every"):
        raise ValueError(f"kv-canary: alias check mode must be 'first' or 'every', got {mode!r}")
    _ALIAS_CHECK[0] = mode


def alias_check_count() -> int:
    """How many output pointers launches have queried in this process."""
    return _ALIAS_CHECKS[0]


def set_phase_timing(on: bool) -> None:
    """Accumulate host time per launch phase (see :func:`phase_times`); off by default. Resets the totals."""
    _TIMING[0] = bool(on)
    _PHASES.clear()


def phase_times() -> dict[str, dict[str, float]]:
    """Host time per phase of the launches since :func:`set_phase_timing`: ``{phase: {"calls", "us_per_call"}}``.

    Phases: ``prepare`` (cached layout lookup), ``import`` (cached imports), ``fence`` (the stream fence
    import), ``dispatch`` (the jitted call), ``outputs`` (alias decisions, pointer checks, copies back),
    ``export`` (the ``torch.from_dlpack`` that orders torch's stream after JAX), ``total``.
    """
    return {k: {"calls": n, "us_per_call": round(t / max(n, 1) * 1e6, 2)} for k, (n, t) in _PHASES.items()}


def _phase(name: str, t0: float) -> float:
    t1 = time.perf_counter()
    e = _PHASES.setdefault(name, [0, 0.0])
    e[0] += 1
    e[1] += t1 - t0
    return t1


@dataclasses.dataclass(frozen=True, slots=True)
class TensorArg:
    """One torch argument of a launch.

    Fields:
      name: argument name (error messages and the body's dict key).
      tensor: the torch tensor, already dtype/shape-checked by the caller.
      mutable: the launch writes it (in place).
      owner: the caller's tensor when ``tensor`` is a view made for this call (e.g. ``.view(torch.uint8)``),
        so cached imports live as long as the caller's tensor; defaults to ``tensor``.
    """

    name: str
    tensor: "torch.Tensor"
    mutable: bool = False
    owner: Any = None  # the caller's long-lived tensor ``tensor`` is a view of (keys the import cache)


# --- platform capabilities --------------------------------------------------------------------------------
_CAPS_LOCK = threading.Lock()
_DONATION: dict[str, bool] = {}


def donation_aliases(device: "torch.device") -> bool:
    """Whether donating a DLPack-imported buffer on this device type returns the output in the same memory.

    Measured once per device type with a 64-byte int32 tensor through ``jit(donate_argnums=0)``.
    """
    key = device.type
    with _CAPS_LOCK:
        if key in _DONATION:
            return _DONATION[key]
    t = torch.zeros(16, dtype=torch.int32, device=device)
    try:
        arr = jax.dlpack.from_dlpack(t, copy=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "donated buffers were not usable" is an answer, not a problem
            out = jax.jit(lambda x: x + 1, donate_argnums=0)(arr)
        out.block_until_ready()
        ok = out.unsafe_buffer_pointer() == t.data_ptr()
        if ok:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ok = int(t[0].item()) == 1
    except Exception:  # noqa: BLE001 - a platform that refuses to donate imported buffers: copy back instead
        ok, out = False, None
    del out
    with _CAPS_LOCK:
        _DONATION[key] = ok
    return ok


# Outputs copied back on CUDA stay referenced until torch's stream has finished reading them (an event per
# launch, polled at the next launches), so JAX cannot recycle their memory under a pending torch copy.
_PENDING: "collections.deque" = collections.deque()


def _retire_pending() -> None:
    while _PENDING and _PENDING[0][0].query():
        _PENDING.popleft()


_FENCES: dict[str, "torch.Tensor"] = {}
_CPU_FENCE: list[jax.Array] = []


def _fence(device: "torch.device", sync: str) -> jax.Array:
    """The first argument of every launch program.

    CUDA with ``sync == "fence"``: a fresh import of a 64-byte torch tensor, on purpose uncached: torch's
    ``__dlpack__(stream=...)`` makes the stream JAX imports on wait for torch's current stream, and the
    imported buffer's definition event then gates the whole JAX computation. Otherwise a constant.
    """
    if device.type == "cpu":
        if not _CPU_FENCE:
            _CPU_FENCE.append(jax.device_put(jnp.zeros((16,), jnp.uint8), jax.devices("cpu")[0]))
        return _CPU_FENCE[0]
    key = str(device)
    t = _FENCES.get(key)
    if t is None:
        t = _FENCES[key] = torch.zeros(64, dtype=torch.uint8, device=device)
    if sync == "fence":
        # The fence's bytes are never read, so no zero-copy / pointer check (a pointer query is an external
        # reference in PJRT, see set_alias_check): only the stream handshake of the import matters.
        return jax.dlpack.from_dlpack(t, copy=False)
    hit = _CACHE.get(("fence", key))
    if hit is None:
        hit = dlpack._import_exact(t, name="fence")
        _CACHE.put(("fence", key), hit, (t,))
    return hit


# --- buffers ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class _Member:
    name: str
    offset: int  # byte offset inside the window
    nbytes: int
    shape: tuple[int, ...]
    kind: str  # "i64" | "i32" | "raw"
    dtype: str
    mutable: bool


@dataclasses.dataclass
class _Buffer:
    view: "torch.Tensor"  # what is imported (pairs view / canary buffer / byte window)
    members: list[_Member]
    window: bool
    owners: list  # weak references to the caller's tensors (never strong: see ImportCache)
    key: Hashable
    mutable: bool


def _kind(t: "torch.Tensor") -> str:
    if t.dtype in (torch.int64, torch.uint64):
        return "i64"
    if t.dtype == torch.int32:
        return "i32"
    return "raw"


def _byte_range(t: "torch.Tensor") -> tuple[int, int]:
    lo = t.data_ptr()
    return lo, lo + t.numel() * t.element_size()


def _check_device_and_aliasing(args: Sequence[TensorArg]) -> "torch.device":
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


def _plan_buffers(args: Sequence[TensorArg], dev: "torch.device") -> list[_Buffer]:
    align = dlpack.device_alignment(dev)
    buffers: list[_Buffer] = []
    scalars_by_storage: dict[int, list[TensorArg]] = {}
    for a in args:
        t = a.tensor
        if t.numel() == 1 and t.element_size() in (4, 8) and _kind(t) != "raw":
            scalars_by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(a)
            continue
        kind = _kind(t)
        view = dlpack.int64_pairs_view(t, a.name) if kind == "i64" else dlpack.contiguous_view(t, a.name)
        m = _Member(a.name, 0, t.numel() * t.element_size(), tuple(t.shape), kind, str(t.dtype), a.mutable)
        owner = a.owner if a.owner is not None else t
        buffers.append(_Buffer(view, [m], False, [_CACHE.ref(owner)], dlpack.ImportCache.key_for(view), a.mutable))
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
                names = ", ".join(m.name for m in members)
                raise ValueError(
                    f"kv-canary: {names} lives in a storage whose base 0x{base:x} is not aligned to {align} bytes; "
                    "XLA cannot import it without a copy"
                )
            view = torch.empty(0, dtype=torch.uint8, device=dev).set_(storage, start - base, (end - start,), (1,))
            mems = [
                _Member(m.name, m.tensor.data_ptr() - start, m.tensor.element_size(), tuple(m.tensor.shape),
                        _kind(m.tensor), str(m.tensor.dtype), m.mutable)
                for m in members
            ]
            buffers.append(
                _Buffer(view, mems, True, [_CACHE.ref(m.owner if m.owner is not None else m.tensor) for m in members],
                        ("win", str(dev), start, end - start), any(m.mutable for m in members))
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


def _import(b: _Buffer) -> jax.Array:
    hit = _CACHE.get(b.key)
    if hit is not None:
        return hit
    arr = dlpack._import_exact(b.view, name=b.members[0].name)
    _CACHE.put(b.key, arr, b.owners)
    return arr


# --- the jitted program -----------------------------------------------------------------------------------
def _unpack(buf: jax.Array, spec: tuple, vals: dict) -> None:
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
            v = jax.lax.bitcast_convert_type(seg.reshape(1, 4), jnp.dtype(m.dtype.replace("torch.", ""))).reshape(m.shape)
        vals[m.name] = v


def _pack(buf: jax.Array, spec: tuple, new: dict) -> jax.Array:
    window, members = spec
    if not window:
        (m,) = members
        out = new[m.name]
        if m.kind == "i64":
            out = jax.lax.bitcast_convert_type(out.astype(jnp.uint32), jnp.int32)
        if out.shape != buf.shape or out.dtype != buf.dtype:
            raise TypeError(f"kv-canary: body returned {out.dtype}{out.shape} for {m.name}, want {buf.dtype}{buf.shape}")
        return out
    out = buf
    for m in members:
        if not m.mutable:
            continue
        v = new[m.name]
        b = jax.lax.bitcast_convert_type(v.reshape(-1), jnp.uint8).reshape(m.nbytes)
        out = jax.lax.dynamic_update_slice(out, b, (m.offset,))
    return out


@functools.lru_cache(maxsize=256)
def _compiled(op: Hashable, statics: Hashable, body_factory: Callable, layout: tuple, donate: bool):
    body = body_factory(statics)
    mutable_idx = tuple(i for i, (window, members) in enumerate(layout) if any(m.mutable for m in members))

    def program(fence, *bufs):
        del fence  # only orders the launch after torch's stream (kept by keep_unused)
        _TRACES[0] += 1
        vals: dict[str, jax.Array] = {}
        for buf, spec in zip(bufs, layout):
            _unpack(buf, spec, vals)
        new = body(vals)
        return tuple(_pack(bufs[i], layout[i], new) for i in mutable_idx)

    donate_argnums = tuple(i + 1 for i in mutable_idx) if donate else ()
    # One _Program per compiled program: which outputs alias their donated inputs is a property of the program
    # (its input/output aliases), so launches on other tensors of the same layout share the decision.
    return _Program(jax.jit(program, donate_argnums=donate_argnums, keep_unused=True), mutable_idx)


# --- the launch -------------------------------------------------------------------------------------------
_LAYOUTS = dlpack.ImportCache(max_entries=256)


@dataclasses.dataclass
class _Program:
    """A jitted launch program, and what its first launch found about aliasing (shared by every prepared
    launch of the same layout and statics)."""

    fn: Callable
    mutable_idx: tuple
    aliases: tuple | None = None  # per mutable output: the torch memory itself (decided by pointer)
    launches: int = 0
    every: bool = False  # a re-check disagreed once: check every launch of this program


@dataclasses.dataclass
class _Prepared:
    """Everything about a launch that depends only on its tensors' addresses, shapes and dtypes."""

    dev: "torch.device"
    buffers: list[_Buffer]
    layout: tuple
    programs: dict


def _signature(args: Sequence[TensorArg]) -> tuple:
    sig = []
    for a in args:
        t = a.tensor
        n = t.numel()
        sig.append((a.name, a.mutable, t.data_ptr(), tuple(t.shape), t.dtype, t.device,
                    t.untyped_storage().data_ptr() if n == 1 else n))
    return tuple(sig)


def _prepare(args: Sequence[TensorArg]) -> _Prepared:
    key = _signature(args)
    hit = _LAYOUTS.get(key)
    if hit is not None:
        return hit
    dev = _check_device_and_aliasing(args)
    buffers = _plan_buffers(args, dev)
    prep = _Prepared(dev, buffers, tuple((b.window, tuple(b.members)) for b in buffers), {})
    _LAYOUTS.put(key, prep, [_LAYOUTS.ref(a.owner if a.owner is not None else a.tensor) for a in args])
    return prep


def run_in_place(op: Hashable, statics: Hashable, body_factory: Callable, args: Sequence[TensorArg]) -> None:
    """Runs ``body_factory(statics)`` on ``args`` and writes the mutable ones back in place (see module doc).

    Args:
      op: a name for the operation (part of the compile-cache key).
      statics: hashable static configuration passed to ``body_factory`` (part of the cache key).
      body_factory: ``statics -> body``; ``body(vals: dict) -> dict`` of new values for the mutable names.
        Must be a module-level function (it is a cache key).
      args: every tensor of the launch.

    Raises:
      ValueError / TypeError: device mix, aliasing outputs, or a tensor that cannot be imported zero-copy;
        raised before anything runs, so no tensor is modified.
    """
    timing = _TIMING[0]
    t0 = t = time.perf_counter() if timing else 0.0
    prep = _prepare(args)
    dev, buffers = prep.dev, prep.buffers
    donate = donation_aliases(dev)
    key = (op, statics, body_factory)
    prog = prep.programs.get(key)
    if prog is None:
        prog = prep.programs[key] = _compiled(op, statics, body_factory, prep.layout, donate)
    fn, mutable_idx = prog.fn, prog.mutable_idx
    sync = _STREAM_SYNC[0] if dev.type == "cuda" else "none"
    if timing:
        t = _phase("prepare", t)
    arrays = [_import(b) for b in buffers]
    if sync == "host":
        torch.cuda.current_stream(dev).synchronize()
    if timing:
        t = _phase("import", t)
    fence = _fence(dev, sync)
    if timing:
        t = _phase("fence", t)
    try:
        outs = fn(fence, *arrays)
    except Exception as e:  # noqa: BLE001
        if not donate:
            raise
        # A runtime that refuses to donate these buffers: remember it and run again without donation (nothing
        # ran: the failure is at dispatch), re-importing the mutable tensors from torch.
        warnings.warn(f"kv-canary: donation failed on {dev.type} ({type(e).__name__}: {e}); copying outputs back")
        with _CAPS_LOCK:
            _DONATION[dev.type] = False
        for b in buffers:
            _CACHE.discard(b.key)
        prep.programs.clear()
        return run_in_place(op, statics, body_factory, args)
    if dev.type == "cpu" or sync == "host":
        jax.block_until_ready(outs)
    if timing:
        t = _phase("dispatch", t)
    if _PENDING:
        _retire_pending()
    # Which outputs are the torch memory: decided by pointer on the first launch of this program, then reused
    # (a pointer query waits for the launch to be dispatched; see set_alias_check).
    prog.launches += 1
    check = donate and (prog.aliases is None or prog.every or _ALIAS_CHECK[0] == "every"
                        or prog.launches % ALIAS_RECHECK_PERIOD == 0)
    if check:
        found = []
        for i, out in zip(mutable_idx, outs):
            b = buffers[i]
            if b.view.numel() == 0:
                found.append(True)
                continue
            _ALIAS_CHECKS[0] += 1
            found.append(out.unsafe_buffer_pointer() == b.view.data_ptr())
        found = tuple(found)
        if prog.aliases is not None and found != prog.aliases:
            warnings.warn(
                f"kv-canary: {op}: outputs that aliased torch memory on the first launch did not on launch "
                f"{prog.launches}; copying them back and checking every launch of this program from now on"
            )
            prog.every = True
        prog.aliases = found
    aliases = prog.aliases if donate else (False,) * len(mutable_idx)
    aliased, copied = [], []
    ordered = False
    for i, out, alias in zip(mutable_idx, outs, aliases):
        b = buffers[i]
        if alias:
            _CACHE.put(b.key, out, b.owners)
            aliased.append(i)
            continue
        if donate:
            _CACHE.discard(b.key)
        src = dlpack.to_torch(out)
        ordered = True
        if b.window:
            for m in b.members:
                if m.mutable:
                    b.view[m.offset : m.offset + m.nbytes].copy_(src[m.offset : m.offset + m.nbytes])
        else:
            b.view.copy_(src)
        copied.append(i)
    if timing:
        t = _phase("outputs", t)
    if sync == "fence" and not ordered and outs:
        dlpack.to_torch(outs[0])  # torch's current stream waits for the JAX computation
    if copied and dev.type == "cuda":
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(dev))
        _PENDING.append((ev, outs))
    if timing:
        t = _phase("export", t)
        _phase("total", t0)
    _LAST_REPORT["layout"] = prep.layout
    _LAST_REPORT["aliased"] = aliased
    _LAST_REPORT["copied"] = copied
    _LAST_REPORT["donated"] = donate
    _LAST_REPORT["alias_checked"] = check
    _LAST_REPORT["program"] = (fn, mutable_idx, [b.view for b in buffers], dev)
    _LAST_REPORT["_prog"] = prog


def last_launch_report() -> dict[str, Any]:
    """What the last :func:`run_in_place` did: names of the mutable buffers that came back ``aliased`` (the
    torch memory itself, nothing copied) and ``copied_back``, whether they were ``donated``, and whether this
    launch asked for its outputs' pointers (``alias_checked``; see :func:`set_alias_check`)."""
    layout = _LAST_REPORT.get("layout", ())
    name = lambda i: "+".join(m.name for m in layout[i][1] if m.mutable)  # noqa: E731
    return {
        "aliased": [name(i) for i in _LAST_REPORT.get("aliased", [])],
        "copied_back": [name(i) for i in _LAST_REPORT.get("copied", [])],
        "donated": _LAST_REPORT.get("donated"),
        "alias_checked": _LAST_REPORT.get("alias_checked"),
    }


def last_launch_program() -> tuple:
    """``(jitted_fn, mutable_idx, views, device)`` of the last launch, for benchmarks that dispatch the very
    same program from JAX: ``jitted_fn(fence, *arrays)`` with one array per torch view (same shape and dtype;
    the arrays at ``mutable_idx`` are donated and come back, in that order, as the outputs)."""
    return _LAST_REPORT["program"]
