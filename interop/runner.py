"""Run a jitted JAX function on torch tensors, updating the mutable ones in place.

:func:`run_in_place` is the one mechanism every torch-facing launcher uses (buffers: :mod:`interop.buffers`;
stream order: :mod:`interop.streams`):

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

import dataclasses
import functools
import threading
import time
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import torch

from interop import buffers, dlpack, streams
from interop.buffers import TensorArg

__all__ = [
    "ALIAS_RECHECK_PERIOD",
    "TensorArg",
    "alias_check_count",
    "donation_aliases",
    "last_launch_program",
    "last_launch_report",
    "phase_times",
    "run_in_place",
    "set_alias_check",
    "set_phase_timing",
    "trace_count",
]

_CACHE = buffers.import_cache()
_TRACES = [0]
_LAST_REPORT: dict[str, Any] = {}
_ALIAS_CHECK = ["first"]
_ALIAS_CHECKS = [0]  # pointer queries of launch outputs made by run_in_place (tests pin steady state)
ALIAS_RECHECK_PERIOD = 1024  # launches of one prepared program between two pointer re-checks
_PHASES: dict[str, list] = {}  # name -> [count, seconds] while phase timing is on
_TIMING = [False]


def trace_count() -> int:
    """Number of times a launcher's JAX function has been traced in this process."""
    return _TRACES[0]


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


# --- platform capabilities --------------------------------------------------------------------------------
_CAPS_LOCK = threading.Lock()
_DONATION: dict[str, bool] = {}


def donation_aliases(device: torch.device) -> bool:
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


# --- the jitted program -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _compiled(op: Hashable, statics: Hashable, body_factory: Callable, layout: tuple, donate: bool):
    body = body_factory(statics)
    mutable_idx = tuple(i for i, (window, members) in enumerate(layout) if any(m.mutable for m in members))

    def program(fence, *bufs):
        del fence  # only orders the launch after torch's stream (kept by keep_unused)
        _TRACES[0] += 1
        vals: dict[str, jax.Array] = {}
        for buf, spec in zip(bufs, layout):
            buffers.unpack(buf, spec, vals)
        new = body(vals)
        return tuple(buffers.pack(bufs[i], layout[i], new) for i in mutable_idx)

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

    dev: torch.device
    buffers: list[buffers.Buffer]
    layout: tuple
    programs: dict


def _signature(args: Sequence[TensorArg]) -> tuple:
    sig = []
    for a in args:
        t = a.tensor
        n = t.numel()
        sig.append(
            (
                a.name,
                a.mutable,
                t.data_ptr(),
                tuple(t.shape),
                t.dtype,
                t.device,
                t.untyped_storage().data_ptr() if n == 1 else n,
            )
        )
    return tuple(sig)


def _prepare(args: Sequence[TensorArg]) -> _Prepared:
    key = _signature(args)
    hit = _LAYOUTS.get(key)
    if hit is not None:
        return hit
    dev = buffers.check_device_and_aliasing(args)
    bufs = buffers.plan_buffers(args, dev)
    prep = _Prepared(dev, bufs, tuple((b.window, tuple(b.members)) for b in bufs), {})
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
    dev, bufs = prep.dev, prep.buffers
    donate = donation_aliases(dev)
    key = (op, statics, body_factory)
    prog = prep.programs.get(key)
    if prog is None:
        prog = prep.programs[key] = _compiled(op, statics, body_factory, prep.layout, donate)
    fn, mutable_idx = prog.fn, prog.mutable_idx
    sync = streams.stream_sync() if dev.type == "cuda" else "none"
    if timing:
        t = _phase("prepare", t)
    arrays = [buffers.import_buffer(b) for b in bufs]
    if sync == "host":
        torch.cuda.current_stream(dev).synchronize()
    if timing:
        t = _phase("import", t)
    fence = streams.fence(dev, sync)
    if timing:
        t = _phase("fence", t)
    try:
        outs = fn(fence, *arrays)
    except Exception as e:  # noqa: BLE001
        if not donate:
            raise
        # A runtime that refuses to donate these buffers: remember it and run again without donation (nothing
        # ran: the failure is at dispatch), re-importing the mutable tensors from torch.
        warnings.warn(
            f"kv-canary: donation failed on {dev.type} ({type(e).__name__}: {e}); copying outputs back", stacklevel=2
        )
        with _CAPS_LOCK:
            _DONATION[dev.type] = False
        for b in bufs:
            _CACHE.discard(b.key)
        prep.programs.clear()
        return run_in_place(op, statics, body_factory, args)
    if dev.type == "cpu" or sync == "host":
        jax.block_until_ready(outs)
    if timing:
        t = _phase("dispatch", t)
    streams.retire_pending()
    # Which outputs are the torch memory: decided by pointer on the first launch of this program, then reused
    # (a pointer query waits for the launch to be dispatched; see set_alias_check).
    prog.launches += 1
    check = donate and (
        prog.aliases is None or prog.every or _ALIAS_CHECK[0] == "every" or prog.launches % ALIAS_RECHECK_PERIOD == 0
    )
    if check:
        found = []
        for i, out in zip(mutable_idx, outs):
            b = bufs[i]
            if b.view.numel() == 0:
                found.append(True)
                continue
            _ALIAS_CHECKS[0] += 1
            found.append(out.unsafe_buffer_pointer() == b.view.data_ptr())
        found = tuple(found)
        if prog.aliases is not None and found != prog.aliases:
            warnings.warn(
                f"kv-canary: {op}: outputs that aliased torch memory on the first launch did not on launch "
                f"{prog.launches}; copying them back and checking every launch of this program from now on",
                stacklevel=2,
            )
            prog.every = True
        prog.aliases = found
    aliases = prog.aliases if donate else (False,) * len(mutable_idx)
    aliased, copied = [], []
    ordered = False
    for i, out, alias in zip(mutable_idx, outs, aliases):
        b = bufs[i]
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
        streams.keep_until_consumed(dev, outs)
    if timing:
        t = _phase("export", t)
        _phase("total", t0)
    _LAST_REPORT["layout"] = prep.layout
    _LAST_REPORT["aliased"] = aliased
    _LAST_REPORT["copied"] = copied
    _LAST_REPORT["donated"] = donate
    _LAST_REPORT["alias_checked"] = check
    _LAST_REPORT["program"] = (fn, mutable_idx, [b.view for b in bufs], dev)
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
