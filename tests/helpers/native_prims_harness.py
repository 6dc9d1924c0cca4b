"""The harness of the native rules' tests (``tests/test_native_prims.py``, ``tests/test_native_prims_compiled.py``):
an evaluator that runs a closed jaxpr equation by equation through :data:`interop.native.prims.RULES` or
:func:`interop.native.prims.compile_rule` (inlining calls, running ``scan`` / ``while`` / ``cond`` on the host),
the byte-for-byte comparison with the jitted jaxpr on XLA:CPU (:func:`check`), and the edge-valued inputs.

:data:`COVERED` counts the primitives run through the rules in this process (``test_every_rule_ran`` reads it).
"""

from __future__ import annotations

import collections

import jax
import jax.extend.core as jcore
import numpy as np
import torch

from interop.native import jaxpr_compat, prims

INLINE = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "remat", "checkpoint")
IN_PLACE = ("scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-max", "scatter-min")
IN_PLACE += ("dynamic_update_slice",)
COVERED: collections.Counter = collections.Counter()  # primitives run through the rules by this module


# --- the evaluator --------------------------------------------------------------------------------------------
def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)


WAYS = ("rules", "compiled", "consts")
"""How the evaluator runs an equation: ``RULES[name]``; ``compile_rule`` (literals constant); ``compile_rule``
with every input not donated passed as a constant."""


class Evaluator:
    """Runs a closed jaxpr through the rules (``way``: one of :data:`WAYS`). Donates operand 0 of in-place
    primitives when, as in the executor, the value dies at that equation and no other live value shares its
    storage."""

    def __init__(self, device: str = "cpu", way: str = "rules"):
        self.device = torch.device(device)
        self.way = way
        self.frames: list[dict] = []
        self.pinned: list[torch.Tensor] = []
        self.counts: collections.Counter = collections.Counter()
        self.donated = 0

    def run(self, closed: jcore.ClosedJaxpr, args: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.device(self.device):  # iota builds on the default device
            return self.jaxpr(closed.jaxpr, closed.consts, args)

    def read(self, env: dict, v) -> torch.Tensor:
        if isinstance(v, jcore.Literal):
            return prims.constant(v.val, v.aval.dtype, self.device)
        return env[v]

    def jaxpr(self, jaxpr, consts, args) -> list[torch.Tensor]:
        env: dict = {}
        self.frames.append(env)
        try:
            for v, c in zip(jaxpr.constvars, consts):
                env[v] = prims.constant(np.asarray(c), v.aval.dtype, self.device)
            for v, a in zip(jaxpr.invars, args):
                env[v] = a
            last = {v: k for k, e in enumerate(jaxpr.eqns) for v in e.invars if not isinstance(v, jcore.Literal)}
            keep = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
            for k, e in enumerate(jaxpr.eqns):
                ins = [self.read(env, v) for v in e.invars]
                for v, o in zip(e.outvars, self.eqn(e, ins, last, k, keep)):
                    if not isinstance(v, jcore.DropVar):
                        env[v] = o
                for v in e.invars:
                    if not isinstance(v, jcore.Literal) and last.get(v) == k and v not in keep:
                        env.pop(v, None)
            return [self.read(env, v) for v in jaxpr.outvars]
        finally:
            self.frames.pop()

    def donate(self, e, ins, last, k, keep) -> tuple[bool, ...]:
        flags = [False] * len(ins)
        v = e.invars[0] if e.invars else None
        if e.primitive.name not in IN_PLACE or isinstance(v, jcore.Literal) or e.invars.count(v) != 1:
            return tuple(flags)
        if last.get(v) != k or v in keep:
            return tuple(flags)
        others = [t for f in self.frames for var, t in f.items() if var is not v] + self.pinned + ins[1:]
        flags[0] = all(_ptr(t) != _ptr(ins[0]) for t in others)
        self.donated += flags[0]
        return tuple(flags)

    def eqn(self, e, ins, last, k, keep) -> list[torch.Tensor]:
        name = e.primitive.name
        self.counts[name] += 1
        if name in INLINE:
            sub = e.params.get("jaxpr") or e.params.get("call_jaxpr") or e.params.get("fun_jaxpr")
            if isinstance(sub, jcore.ClosedJaxpr):
                return self.jaxpr(sub.jaxpr, sub.consts, ins)
            return self.jaxpr(sub, (), ins)
        if name == jaxpr_compat.HI_CALL:
            sub = jaxpr_compat.expansion(e)
            return self.jaxpr(sub.jaxpr, sub.consts, ins)
        if name == "scan":
            return self.scan(e, ins)
        if name == "while":
            return self.while_loop(e, ins)
        if name == "cond":
            branches = e.params["branches"]
            i = min(max(int(ins[0].item()), 0), len(branches) - 1)
            return self.jaxpr(branches[i].jaxpr, branches[i].consts, ins[1:])
        donate = self.donate(e, ins, last, k, keep)
        if self.way == "rules":
            outs = prims.rule_for(e)(e, ins, donate)
        else:
            consts = {i: t for i, t in enumerate(ins) if not donate[i]} if self.way == "consts" else {}
            outs = prims.compile_rule(e, self.device, consts)(ins, donate)
        assert len(outs) == len(e.outvars), name
        for o, v in zip(outs, e.outvars):
            want = (tuple(v.aval.shape), prims.storage_dtype(v.aval.dtype))
            assert (tuple(o.shape), o.dtype) == want, (name, tuple(o.shape), o.dtype, want)
        return outs

    def scan(self, e, ins):
        p = e.params
        (nc, nk), body = jaxpr_compat.scan_counts(p), p["jaxpr"]
        consts, carry, xs = ins[:nc], ins[nc : nc + nk], ins[nc + nk :]
        ys = []
        n_pinned = len(self.pinned)
        for t in range(p["length"] - 1, -1, -1) if p["reverse"] else range(p["length"]):
            self.pinned.extend(carry)
            out = self.jaxpr(body.jaxpr, body.consts, [*consts, *carry, *(x[t] for x in xs)])
            carry, y = out[:nk], out[nk:]
            ys.append(y)
            self.pinned.extend(y)
        del self.pinned[n_pinned:]
        if p["reverse"]:
            ys.reverse()
        stacked = []
        for j, v in enumerate(e.outvars[nk:]):
            st = prims.storage_dtype(v.aval.dtype)
            stacked.append(torch.stack([y[j] for y in ys]) if ys else torch.empty(v.aval.shape, dtype=st))
        return [*carry, *stacked]

    def while_loop(self, e, ins):
        p = e.params
        cn, bn, cj, bj = p["cond_nconsts"], p["body_nconsts"], p["cond_jaxpr"], p["body_jaxpr"]
        cconsts, bconsts, carry = ins[:cn], ins[cn : cn + bn], ins[cn + bn :]
        n_pinned = len(self.pinned)
        while True:
            self.pinned.extend(carry)
            (pred,) = self.jaxpr(cj.jaxpr, cj.consts, [*cconsts, *carry])
            if not bool(pred.item()):
                break
            carry = self.jaxpr(bj.jaxpr, bj.consts, [*bconsts, *carry])
        del self.pinned[n_pinned:]
        return carry


# --- comparing with XLA ---------------------------------------------------------------------------------------
def _bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _host_control_flow(jaxpr) -> bool:
    """Whether a ``while`` / ``cond`` (run on the host here, refused by the executor) is anywhere inside."""
    if any(e.primitive.name in ("while", "cond") for e in jaxpr.eqns):
        return True
    return any(_host_control_flow(sub) for sub in jcore.subjaxprs(jaxpr))


def run_ways(closed: jcore.ClosedJaxpr, args: list[np.ndarray], make_ev=None):
    """(XLA outputs, {way: our outputs}, {way: evaluator}) with outputs as numpy arrays, ours run each of
    :data:`WAYS` (``make_ev(way)`` makes the evaluator); also runs the rules and the compiled rules on the meta
    device (shapes only) where there is no host control flow."""
    ref = [np.asarray(o) for o in jax.jit(jcore.jaxpr_as_fun(closed))(*args)]
    make_ev = make_ev or (lambda way: Evaluator(way=way))
    ours, evs = {}, {}
    for way in WAYS:
        ev = evs[way] = make_ev(way)
        outs = ev.run(closed, [prims.from_numpy(np.asarray(a), "cpu") for a in args])
        ours[way] = [prims.to_numpy(o, v.aval.dtype) for o, v in zip(outs, closed.jaxpr.outvars)]
    if not _host_control_flow(closed.jaxpr):
        for way in WAYS[:2]:
            meta = Evaluator("meta", way).run(
                closed,
                [torch.empty(np.shape(a), dtype=prims.storage_dtype(np.asarray(a).dtype), device="meta") for a in args],
            )
            assert [tuple(m.shape) for m in meta] == [o.shape for o in ours["rules"]], way
    COVERED.update(evs["rules"].counts)
    return ref, ours, evs


def _diff(r: np.ndarray, o: np.ndarray, args) -> str:
    """The first differing elements, as bits, with the inputs at the same flat position (where shapes match)."""
    rb, ob = _bytes(r).reshape(r.size, -1), _bytes(o).reshape(o.size, -1)
    bad = np.flatnonzero((rb != ob).any(1))[:6]
    hexs = lambda a, k: a.reshape(-1)[k : k + 1].view(np.uint8).tobytes()[::-1].hex()  # noqa: E731
    ins = lambda k: [np.asarray(a).reshape(-1)[k] for a in args if np.size(a) == r.size]  # noqa: E731
    return "; ".join(f"[{k}] xla={hexs(r, k)} ours={hexs(o, k)} inputs={ins(k)}" for k in bad)


def _same(r: np.ndarray, o: np.ndarray) -> bool:
    """Same bytes, with any NaN for a NaN (which input NaN propagates is the hardware's choice)."""
    if kind(r.dtype) == "f":
        r, o = r.copy(), o.copy()
        r[np.isnan(r) & np.isnan(o)] = o[np.isnan(r) & np.isnan(o)]
    return np.array_equal(_bytes(r), _bytes(o))


def check(fn, *args, exact=True, rtol=1e-6):
    """Traces ``fn(*args)``, runs it every way and compares every output (bytes, or allclose for
    ``exact=False``)."""
    closed = jax.make_jaxpr(fn)(*args)
    ref, ours, evs = run_ways(closed, list(args))
    for way, outs in ours.items():
        assert len(ref) == len(outs)
        for i, (r, o) in enumerate(zip(ref, outs)):
            assert r.dtype == o.dtype and r.shape == o.shape, (way, i, r.dtype, o.dtype, r.shape, o.shape)
            if exact:
                if not _same(r, o):
                    raise AssertionError(f"{way}: output {i} differs: {_diff(r, o, args)}\nin {closed}")
            else:
                np.testing.assert_allclose(o.astype(np.float64), r.astype(np.float64), rtol=rtol, equal_nan=True)
    return evs["rules"]


# --- inputs ---------------------------------------------------------------------------------------------------
INTS = ["int8", "uint8", "int16", "uint16", "int32", "uint32"]
FLOATS = ["float32", "float16", "bfloat16"]


def kind(dt) -> str:
    return "f" if np.dtype(dt).name == "bfloat16" else np.dtype(dt).kind


def edge_values(dtype) -> list:
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return [False, True]
    if kind(dt) == "f":
        return [0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 3.0, np.inf, -np.inf, np.nan, -np.nan, 1e-3, 65504.0, 7.0]
    info = np.iinfo(dt)
    bits = dt.itemsize * 8
    vals = [0, 1, 2, 3, 7, info.max, info.min, info.max - 1, info.min + 1, bits - 1, bits, bits + 1]
    vals += [-1, -2, -7] if kind(dt) == "i" else [info.max // 2, info.max // 2 + 1]
    return vals


def _ints(values, dt) -> np.ndarray:
    """Python ints as dtype ``dt``, wrapping."""
    return np.array([int(v) % 2**64 for v in values], dtype=np.uint64).astype(dt)


def sample(dtype, shape, rng: np.random.Generator) -> np.ndarray:
    """Edge values first, then random bits."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape))
    edges = np.array(edge_values(dt), dtype=np.float64 if kind(dt) == "f" else object)
    if kind(dt) == "f":
        rest = rng.normal(0, 100, n).astype(dt)
        vals = np.concatenate([edges.astype(dt), rest])
    elif dt == np.bool_:
        vals = rng.integers(0, 2, n + 2).astype(bool)
    else:
        rest = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8).view(dt)
        vals = np.concatenate([_ints(edges, dt), rest])
    perm = rng.permutation(n) % len(vals)
    return vals[np.arange(n) % len(vals)][perm].reshape(shape) if n else np.zeros(shape, dt)


def pair(dtype, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Two arrays holding every (edge, edge) combination, plus random ones."""
    e = np.array(edge_values(dtype), dtype=np.float64 if kind(np.dtype(dtype)) == "f" else object)
    a, b = np.meshgrid(np.arange(len(e)), np.arange(len(e)))
    a, b = e[a.reshape(-1)], e[b.reshape(-1)]
    dt = np.dtype(dtype)
    cast = (lambda x: x.astype(dt)) if kind(dt) == "f" else (lambda x: _ints(x, dt))
    return np.concatenate([cast(a), sample(dt, (n,), rng)]), np.concatenate([cast(b), sample(dt, (n,), rng)])


MODES = ["clip", "fill", "promise_in_bounds"]
BAD_ROWS = [0, 3, 5, 6, -1, 2**31 - 1, -(2**31), 5, 0, 2]  # for a 6-row operand
