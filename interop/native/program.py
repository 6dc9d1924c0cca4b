"""A traced launch body as a straight list of torch steps: the executor of the native torch path.

:func:`build` takes the closed jaxpr of a launch body (``jax.make_jaxpr`` of a verify / write / plan body of
:mod:`interop.kernels`) and turns it into a :class:`Program`:

1. **Flatten.** ``pjit`` / ``jit`` / ``closed_call`` / ``custom_jvp_call`` / ``custom_vjp_call`` bodies are
   inlined; a ``scan`` is unrolled (its trip count is static and, in our plans, the log2 steps of a
   ``searchsorted``); ``cond`` and ``while`` are refused (they would need a host sync per step).
2. **Fold constants.** Every step whose inputs are all literals or constants (``iota``, broadcasts of
   literals, ...) runs once, at build time, on the launch's device.
3. **Plan memory.** Like XLA's buffer assignment, but conservative: each value belongs to the buffers it may
   share memory with (a view shares its input's; a fresh result gets its own). A step may overwrite an input in
   place (a ``pallas_call`` operand it aliases to an output, a scatter's operand) only when nothing read later
   shares that memory, the memory is not a constant, and it is not a read-only argument of the launch;
   otherwise the step works on a copy, as XLA would. (This pass, the rules compiled with their constants and
   the fused views are :mod:`interop.native.program_passes`'.)
4. **Run.** Each primitive runs through its torch rule (:mod:`interop.native.prims`); each compiled
   ``pallas_call`` through its Triton kernel (:mod:`interop.native.triton_kernels`) on torch's current stream;
   an interpreted ``pallas_call`` (CPU launches) through JAX's interpreter on host copies. No step reads a value
   back to the host, so a torch CUDA graph can capture a whole launch.

Values live in torch *storage* dtypes (:func:`interop.native.prims.storage_dtype`: unsigned integers as the
signed type's bit pattern), so every tensor holds the same bytes XLA would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import numpy as np
import torch

from interop.native import jaxpr_compat, prims
from interop.native.program_passes import (  # noqa: F401  (re-exported: their first home is here)
    IN_PLACE,
    VIEW_OF_FIRST,
    Step,
    _compile,
    _fuse_views,
    _plan_memory,
)

INLINED = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "remat", "checkpoint")
"""Primitives whose body is inlined into the step list."""

REFUSED = ("while",)
"""Control flow the native path refuses: its trip count would need a host read per launch. (A ``cond`` without
kernels runs every branch and selects the results on the device; one with a ``pallas_call`` is refused.)"""

MAX_UNROLL = 64
"""Largest ``scan`` trip count unrolled (ours are a ``searchsorted``'s log2 steps)."""


class NotNative(NotImplementedError):
    """A launch body the native path cannot run (names the primitive and why)."""


class _Builder:
    """Flattens a closed jaxpr into steps over integer value ids."""

    def __init__(self, device: torch.device, pallas: Callable):
        self.device = device
        self.pallas = pallas  # eqn -> (run, inplace positions, kernel object)
        self.steps: list[Step] = []
        self.consts: dict[int, torch.Tensor] = {}
        self.avals: list[Any] = []

    def new(self, aval) -> int:
        self.avals.append(aval)
        return len(self.avals) - 1

    def const(self, value, aval) -> int:
        i = self.new(aval)
        self.consts[i] = prims.constant(np.asarray(value), aval.dtype, self.device)
        return i

    def read(self, env: dict, v) -> int:
        if isinstance(v, jcore.Literal):
            return self.const(v.val, v.aval)
        return env[v]

    def inline(self, jaxpr, consts: Sequence, args: Sequence[int]) -> list[int]:
        """Adds the steps of ``jaxpr`` (a core Jaxpr) applied to value ids ``args``; returns its output ids."""
        env: dict = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = self.const(c, v.aval)
        for v, a in zip(jaxpr.invars, args):
            env[v] = a
        for eqn in jaxpr.eqns:
            ins = [self.read(env, v) for v in eqn.invars]
            outs = self.eqn(eqn, ins)
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
        return [self.read(env, v) for v in jaxpr.outvars]

    def eqn(self, eqn, ins: list[int]) -> list[int]:
        name = eqn.primitive.name
        if name in INLINED:
            sub = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
            if isinstance(sub, jcore.ClosedJaxpr):
                return self.inline(sub.jaxpr, sub.consts, ins)
            return self.inline(sub, (), ins)
        if name == jaxpr_compat.HI_CALL:  # jax 0.12's high-level primitives (jnp.searchsorted): their expansion
            sub = jaxpr_compat.expansion(eqn)
            return self.inline(sub.jaxpr, sub.consts, ins)
        if name == "scan":
            return self.scan(eqn, ins)
        if name == "cond":
            return self.cond(eqn, ins)
        if name in REFUSED:
            raise NotNative(
                f"the native torch path cannot run a {name!r} in a launch body (it would read a value back to the "
                "host every launch); use the DLPack path (path='dlpack'), or backend='pallas' whose kernels it runs"
            )
        outs = [self.new(v.aval) for v in eqn.outvars]
        if name == "pallas_call":
            run, inplace, kernel = self.pallas(eqn)
            self.steps.append(Step(name, run, tuple(ins), tuple(outs), False, tuple(inplace), kernel=kernel))
            return outs
        fresh = name in prims.FRESH and name not in IN_PLACE
        inplace = (0,) if name in IN_PLACE else ()
        rule = prims.rule_for(eqn)  # refuses an unsupported primitive now; compiled after folding (_compile)

        def run(args, donate, rule=rule, eqn=eqn):
            return rule(eqn, args, donate)

        self.steps.append(Step(name, run, tuple(ins), tuple(outs), fresh, inplace, eqns=(eqn,)))
        return outs

    def scan(self, eqn, ins: list[int]) -> list[int]:
        p = eqn.params
        length, (nc, nk) = int(p["length"]), jaxpr_compat.scan_counts(p)
        if length > MAX_UNROLL:
            raise NotNative(f"a scan of length {length} (the native path unrolls at most {MAX_UNROLL} trips)")
        body: jcore.ClosedJaxpr = p["jaxpr"]
        consts, carry, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
        ys_per_trip: list[list[int]] = []
        order = range(length - 1, -1, -1) if p["reverse"] else range(length)
        for t in order:
            x_t = [self.index(x, t) for x in xs]
            out = self.inline(body.jaxpr, body.consts, [*consts, *carry, *x_t])
            carry, ys = out[:nk], out[nk:]
            ys_per_trip.append(ys)
        if p["reverse"]:
            ys_per_trip.reverse()
        stacked = [self.stack([trip[k] for trip in ys_per_trip], v.aval) for k, v in enumerate(eqn.outvars[nk:])]
        return [*carry, *stacked]

    def cond(self, eqn, ins: list[int]) -> list[int]:
        """Every branch inlined, then the results selected by the (clamped) branch index on the device."""
        branches = eqn.params["branches"]
        for br in branches:
            if any(e.primitive.name == "pallas_call" for e in _all_eqns(br.jaxpr)):
                raise NotNative(
                    "the native torch path cannot run a cond with a pallas_call in a branch (it would run every "
                    "branch's kernel); use the DLPack path (path='dlpack')"
                )
        index, ops = ins[0], ins[1:]
        results = [self.inline(br.jaxpr, br.consts, ops) for br in branches]
        outs = []
        for k, v in enumerate(eqn.outvars):
            out = self.new(v.aval)
            n = len(branches)

            def select(a, d, n=n):
                idx, vals = a[0].to(torch.int64).clamp(0, n - 1), a[1:]
                res = vals[0]
                for j in range(1, n):
                    res = torch.where(idx == j, vals[j], res)
                return [res.clone() if n == 1 else res]

            self.steps.append(Step("cond_select", select, (index, *(r[k] for r in results)), (out,), True))
            outs.append(out)
        return outs

    def index(self, x: int, t: int) -> int:
        aval = self.avals[x]
        out = self.new(aval.update(shape=aval.shape[1:]))
        self.steps.append(Step("scan_index", lambda a, d, t=t: [a[0][t]], (x,), (out,), False))
        return out

    def stack(self, ids: list[int], aval) -> int:
        out = self.new(aval)
        self.steps.append(Step("scan_stack", lambda a, d: [torch.stack(a)], tuple(ids), (out,), True))
        return out


def _all_eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs in its equations' parameters."""
    for e in jaxpr.eqns:
        yield e
        for sub in jcore.jaxprs_in_params(e.params):
            yield from _all_eqns(sub)


def _fold_constants(b: _Builder) -> list[Step]:
    """Runs, once, every step whose inputs are all constants (never a pallas_call); returns the rest."""
    rest = []
    for s in b.steps:
        if s.name != "pallas_call" and all(i in b.consts for i in s.ins):
            outs = s.run([b.consts[i] for i in s.ins], (False,) * len(s.ins))
            for i, o in zip(s.outs, outs):
                b.consts[i] = o
        else:
            rest.append(s)
    return rest


@dataclasses.dataclass
class Program:
    """A launch body compiled to torch steps: ``program(inputs) -> outputs`` (storage tensors)."""

    steps: list[Step]
    num_values: int
    consts: dict[int, torch.Tensor]
    in_ids: tuple[int, ...]
    out_ids: tuple[int, ...]
    avals_in: tuple
    avals_out: tuple
    avals: tuple = ()  # of every value id
    clone_outs: tuple = ()  # per output: copy before the write-back (see _plan_memory)

    _run: Callable | None = None  # the straight-line function, generated on the first call

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self._run is None:
            self._run = self._straight_line()
        outs = self._run(inputs)
        return [o.clone() if c else o for o, c in zip(outs, self.clone_outs)] if any(self.clone_outs) else outs

    def _straight_line(self) -> Callable:
        """The steps as one generated Python function (locals instead of an environment list, dead values
        deleted as they die): about 0.7 us per step less than a loop. The steps' ``run`` functions and donation
        flags are bound now, so a step changed after the first call is not seen."""
        ns: dict[str, Any] = {}

        def name(i: int) -> str:
            if i in self.consts:
                ns.setdefault(f"c{i}", self.consts[i])
                return f"c{i}"
            return f"v{i}"

        lines = ["def run(inputs):"]
        if self.in_ids:
            lines.append(f"    ({', '.join(name(i) for i in self.in_ids)},) = inputs")
        for k, s in enumerate(self.steps):
            ns[f"r{k}"], ns[f"d{k}"] = s.run, s.donate
            args = ", ".join(name(i) for i in s.ins)
            lines.append(f"    ({', '.join(f'v{i}' for i in s.outs)},) = r{k}([{args}], d{k})")
            dead = [f"v{i}" for i in s.drop if i not in self.consts]
            if dead:
                lines.append(f"    del {', '.join(dead)}")
        lines.append(f"    return [{', '.join(name(i) for i in self.out_ids)}]")
        exec(compile("\n".join(lines), f"<canary native program {id(self):x}>", "exec"), ns)  # noqa: S102
        return ns["run"]


def build(closed: jcore.ClosedJaxpr, *, device: torch.device, mutable: Sequence[bool], pallas: Callable) -> Program:
    """Compiles a closed jaxpr to a :class:`Program` on ``device``.

    Args:
      closed: the launch body's closed jaxpr (flat inputs and outputs).
      device: where the launch's tensors live.
      mutable: per flat input, whether the launch may overwrite it (a read-only input is never donated).
      pallas: ``eqn -> (run, inplace_positions, kernel)`` for a ``pallas_call`` equation, where ``kernel`` has
        an ``aliases`` attribute (pairs ``(input position, output position)``).

    Raises:
      NotNative: control flow the native path refuses, or a scan past :data:`MAX_UNROLL`.
      interop.native.prims.UnsupportedPrimitive: a primitive without a torch rule.
    """
    b = _Builder(device, pallas)
    in_ids = [b.new(v.aval) for v in closed.jaxpr.invars]
    with torch.device(device):  # constants folded now land on the launch's device
        out_ids = b.inline(closed.jaxpr, closed.consts, in_ids)
        steps = _fold_constants(b)
    _compile(steps, b.consts, device)
    steps = _fuse_views(steps, out_ids, device)
    clone_outs = _plan_memory(steps, in_ids, out_ids, mutable, b.consts)
    return Program(
        steps,
        len(b.avals),
        b.consts,
        tuple(in_ids),
        tuple(out_ids),
        tuple(v.aval for v in closed.jaxpr.invars),
        tuple(v.aval for v in closed.jaxpr.outvars),
        tuple(b.avals),
        clone_outs,
    )


def interpreted_pallas(eqn) -> tuple[Callable, tuple[int, ...], Any]:
    """A ``pallas_call`` with ``interpret=True`` run by JAX's interpreter on host copies (CPU launches).

    Every output is a fresh tensor (the aliasing is by value: the copy-out of the launch writes results back),
    so no input is overwritten in place.
    """
    in_dtypes = [v.aval.dtype for v in eqn.invars]
    out_dtypes = [v.aval.dtype for v in eqn.outvars]
    kernel = _Interpreted(tuple(eqn.params["input_output_aliases"]), eqn.params.get("name") or "pallas_call")

    call = jax.jit(lambda *xs: eqn.primitive.bind(*xs, **eqn.params))  # compiled once, on first use

    def run(args, donate):
        del donate
        dev = args[0].device if args else torch.device("cpu")
        xs = [prims.to_numpy(a, dt) for a, dt in zip(args, in_dtypes)]
        outs = call(*xs)
        return [prims.from_numpy(np.asarray(o).astype(dt, copy=False), dev) for o, dt in zip(outs, out_dtypes)]

    return run, (), kernel


@dataclasses.dataclass(frozen=True)
class _Interpreted:
    aliases: tuple
    name: str
