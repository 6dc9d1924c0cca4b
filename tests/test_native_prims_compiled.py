"""interop.native.prims' compiled forms: every subset of constant operands (donated and not) against XLA:CPU for
gather and the scatter family, the few torch ops a compiled step runs, a compiled rule's device, view chains run
as one call, and a scatter that writes a donated operand in place and copies otherwise. The harness is
``tests/helpers/native_prims_harness.py``; the rules against XLA are ``tests/test_native_prims.py``'s.
"""

from __future__ import annotations

import itertools

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax import lax
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.native_prims_harness import (
    BAD_ROWS,
    MODES,
    _bytes,
    _diff,
    _same,
    sample,
)
from interop.native import prims, prims_views


def test_scatter_writes_a_donated_operand_in_place_and_copies_otherwise():
    x = np.arange(24, dtype=np.uint32).reshape(6, 4) * 3
    upd = np.full((3, 4), 2**32 - 2, np.uint32)
    rows = np.array([[1], [9], [1]], np.int32)
    dn = lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                     scatter_dims_to_operand_dims=(0,))  # fmt: skip
    fns = {
        "scatter": lambda x, i, u: lax.scatter(x, i, u, dn, mode="drop"),
        "scatter-add": lambda x, i, u: lax.scatter_add(x, i, u, dn, mode="drop"),
        "scatter-max": lambda x, i, u: lax.scatter_max(x, i, u, dn, mode="drop"),
        "scatter-min": lambda x, i, u: lax.scatter_min(x, i, u, dn, mode="clip"),
        "scatter-mul": lambda x, i, u: lax.scatter_mul(x, i, u, dn, mode="drop"),
        "dynamic_update_slice": lambda x, i, u: lax.dynamic_update_slice_p.bind(x, u, i, np.int32(0)),
    }
    for name, fn in fns.items():
        args = (x, np.int32(1) if name == "dynamic_update_slice" else rows, upd)
        closed = jax.make_jaxpr(fn)(*args)
        (eqn,) = closed.jaxpr.eqns
        assert eqn.primitive.name == name
        (want,) = jax.jit(jcore.jaxpr_as_fun(closed))(*args)
        by_var = dict(zip(closed.jaxpr.invars, args))
        ins = [
            prims.constant(v.val if isinstance(v, jcore.Literal) else by_var[v], v.aval.dtype, "cpu")
            for v in eqn.invars
        ]
        for donate, consts in itertools.product((True, False), (None, (), (1, 2), tuple(range(1, len(ins))))):
            operand, before = ins[0].clone(), ins[0].clone()
            args, flags = [operand, *ins[1:]], (donate,) + (False,) * (len(ins) - 1)
            if consts is None:  # the rule, else compile_rule with these inputs constant
                (out,) = prims.rule_for(eqn)(eqn, args, flags)
            else:
                (out,) = prims.compile_rule(eqn, "cpu", {i: args[i] for i in consts})(args, flags)
            assert np.array_equal(prims.to_numpy(out, np.uint32), np.asarray(want)), (name, consts)
            assert (out.data_ptr() == operand.data_ptr()) == donate, (name, consts)
            assert torch.equal(operand, out if donate else before), (name, consts)
    # a donated operand that is a broadcast (stride-0) view is never written through
    (eqn,) = jax.make_jaxpr(fns["scatter"])(x, rows, upd).jaxpr.eqns
    base = torch.zeros(1, 4, dtype=torch.int32)
    args = [base.expand(6, 4), prims.from_numpy(rows, "cpu"), prims.from_numpy(upd, "cpu")]
    for run in (lambda a, d: prims.rule_for(eqn)(eqn, a, d), prims.compile_rule(eqn, "cpu"),
                prims.compile_rule(eqn, "cpu", {1: args[1], 2: args[2]})):  # fmt: skip
        (out,) = run(args, (True, False, False))
        assert torch.equal(base, torch.zeros(1, 4, dtype=torch.int32)) and out.is_contiguous()
        assert prims.to_numpy(out, np.uint32)[1].tolist() == [2**32 - 2] * 4


SCATTER_DNS = {
    "row": lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                       scatter_dims_to_operand_dims=(0,)),
    "elt": lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=(0, 1),
                                       scatter_dims_to_operand_dims=(0, 1)),
    "win": lax.ScatterDimensionNumbers(update_window_dims=(1, 2), inserted_window_dims=(),
                                       scatter_dims_to_operand_dims=(1, 0)),
}  # fmt: skip


def _eqn_args(closed, args):
    """Each equation of ``closed`` (all reading invars) with its input arrays."""
    by_var = dict(zip(closed.jaxpr.invars, args))
    for e in closed.jaxpr.eqns:
        yield e, [v.val if isinstance(v, jcore.Literal) else by_var[v] for v in e.invars]


def _every_constant_subset(closed, args):
    """Runs every equation of ``closed`` (one output each, all reading invars) through ``compile_rule`` with every
    subset of its inputs constant, donated and not, and compares the bytes with XLA's."""
    want = jax.jit(jcore.jaxpr_as_fun(closed))(*args)
    runs = 0
    for (e, ins), w in zip(_eqn_args(closed, args), want):
        w = np.asarray(w)
        for consts in itertools.chain.from_iterable(itertools.combinations(range(len(ins)), k) for k in range(4)):
            for donate in (False, True):
                if donate and 0 in consts:
                    continue  # the executor never donates a constant
                ts = [prims.constant(a, v.aval.dtype, "cpu") for a, v in zip(ins, e.invars)]
                dt0 = e.invars[0].aval.dtype
                before = _bytes(prims.to_numpy(ts[0], dt0))
                flags = (donate,) + (False,) * (len(ts) - 1)
                (out,) = prims.compile_rule(e, "cpu", {i: ts[i] for i in consts})(ts, flags)
                got = prims.to_numpy(out, e.outvars[0].aval.dtype)
                assert _same(w, got), (e, consts, donate, _diff(w, got, ins))
                if not donate:
                    assert np.array_equal(_bytes(prims.to_numpy(ts[0], dt0)), before), (e.primitive.name, consts)
                runs += 1
    return runs


@pytest.mark.parametrize("dtype", ["uint32", "int32", "float32", "bool"])
def test_compiled_gather_scatter_with_every_constant_subset(dtype):
    """Constant indices (out of range and duplicate ones included) and constant updates take precomputed paths;
    unsigned max (min) with constant updates all below (at or above) 2**31 runs as a signed scatter."""
    rng = np.random.default_rng(14)
    x = sample(dtype, (6, 4), rng)
    if dtype == "uint32":
        x[:3] |= np.uint32(2**31)  # targets on both sides of the sign bit
    rows = np.array(BAD_ROWS + [3, 3], np.int32)
    idx = {
        "row": rows[:, None],
        "elt": np.stack([rows, (rows * 3) % 5], 1),
        "win": np.stack([(rows * 3) % 5, rows], 1)[:6],
    }
    u = sample(dtype, (12, 4), rng)
    upd_sets = [u]
    if dtype == "uint32":
        upd_sets += [u & np.uint32(2**31 - 1), u | np.uint32(2**31)]
    fns = [lax.scatter, lax.scatter_max, lax.scatter_min]
    if dtype != "bool":
        fns += [lax.scatter_add, lax.scatter_mul, lax.scatter_sub]
    runs = 0
    for u in upd_sets:
        upd = {"row": u, "elt": u[:, 0], "win": u[:6, :2].reshape(6, 2, 1)}

        def f(x, ir, ie, iw, ur, ue, uw):
            i, v = {"row": ir, "elt": ie, "win": iw}, {"row": ur, "elt": ue, "win": uw}
            return [fn(x, i[k], v[k], dn, mode=m) for fn in fns for m in MODES for k, dn in SCATTER_DNS.items()]

        args = [x, idx["row"], idx["elt"], idx["win"], upd["row"], upd["elt"], upd["win"]]
        runs += _every_constant_subset(jax.make_jaxpr(f)(*args), args)
    g_rows = rows.astype({"uint32": np.uint32, "float32": np.uint8, "bool": np.int16}.get(dtype, np.int32))
    row_dn = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
    win_dn = lax.GatherDimensionNumbers(offset_dims=(0, 2), collapsed_slice_dims=(), start_index_map=(1, 0))
    g = lambda x, r, w: [lax.gather(x, i, dn, s, mode=m) for m in MODES  # noqa: E731
                         for i, dn, s in ((r, row_dn, (1, 4)), (w, win_dn, (2, 3)), (r, row_dn, (1, 2)))]  # fmt: skip
    gargs = [x, g_rows[:, None], np.stack([(rows * 3) % 5, rows], 1).reshape(6, 2, 2)]
    runs += _every_constant_subset(jax.make_jaxpr(g)(*gargs), gargs)
    assert runs > 300


class _CountOps(TorchDispatchMode):
    """The aten ops run inside it, by name."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ != "detach":  # view(dtype) detaches under a dispatch mode only
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _ops(fn, args, consts=(), donate=False):
    """(torch ops one call of the compiled single equation of ``fn(*args)`` runs, its output as numpy), after
    checking it against XLA."""
    closed = jax.make_jaxpr(fn)(*args)
    (e,) = closed.jaxpr.eqns
    (want,) = jax.jit(jcore.jaxpr_as_fun(closed))(*args)
    (_, ins), *_ = _eqn_args(closed, args)
    ts = [prims.constant(a, v.aval.dtype, "cpu") for a, v in zip(ins, e.invars)]
    run = prims.compile_rule(e, "cpu", {i: ts[i] for i in consts})
    with _CountOps() as c:
        (out,) = run(ts, (donate,) + (False,) * (len(ts) - 1))
    got = prims.to_numpy(out, e.outvars[0].aval.dtype)
    assert _same(np.asarray(want), got), e
    return c.ops


def test_compiled_steps_run_few_torch_ops():
    """The glue of the write / verify launches: constant-index scatters and gathers are one op, views one call."""
    assert _ops(lambda x, i, u: lax.scatter_add(x, i, u, SCATTER_DNS["row"]), (np.zeros((4, 2), np.int32),
                np.zeros((0, 1), np.int32), np.zeros((0, 2), np.int32))) == ["clone"]  # fmt: skip
    z, r = np.zeros((12, 2), np.uint32), np.array([[7, 2**32 - 1]], np.uint32)
    row = lambda z, i, r: lax.scatter(z, i, r, SCATTER_DNS["row"], mode="drop", unique_indices=True)  # noqa: E731
    for i in ([[2]], [[12]], [[-1]]):
        i = np.array(i, np.int32)
        want = ["where"] if i[0, 0] == 2 else ["clone"]  # a row broadcasts into place; dropped: a copy
        assert _ops(row, (z, i, r), consts=(0, 1)) == want
        assert _ops(row, (z, i, r), consts=(1,), donate=True) == (["index_put_"] if i[0, 0] == 2 else [])
    x = sample("uint32", (6, 4), np.random.default_rng(15))
    dn = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
    rows = np.array([[0], [5], [3], [3]], np.int32)
    for mode in MODES:
        assert _ops(lambda x, i, m=mode: lax.gather(x, i, dn, (1, 4), mode=m), (x, rows), consts=(1,)) == ["take"]
    bad = np.array([[0], [6], [-1]], np.int32)
    assert _ops(lambda x, i: lax.gather(x, i, dn, (1, 4), mode="fill"), (x, bad), consts=(1,)) == ["take", "where"]
    assert len(_ops(lambda x, i: lax.gather(x, i, dn, (1, 4), mode="clip"), (x, bad))) <= 4  # clamp, index_select
    b = sample("uint8", (61, 48), np.random.default_rng(16))
    assert len(_ops(lambda b: b.reshape(61, 12, 4), (b,))) == 1
    assert len(_ops(lambda b: lax.bitcast_convert_type(b, jnp.uint32), (b.reshape(61, 12, 4),))) <= 2
    assert len(_ops(lambda u: lax.bitcast_convert_type(u, jnp.uint8), (x,))) <= 2
    assert len(_ops(lambda u: lax.slice(u, (2, 0), (3, 4)), (x,))) == 1
    assert len(_ops(lambda u: lax.squeeze(u, (0,)), (x[2:3],))) == 1
    assert len(_ops(lambda v: lax.broadcast_in_dim(v, (1, 4), (1,)), (x[2],))) == 1
    assert _ops(lambda u: u.astype(jnp.int32), (x,)) == []
    assert len(_ops(lambda u: lax.lt(u, np.uint32(5)), (x,))) == 2  # the literal keyed once
    assert len(_ops(lambda u: lax.shift_right_logical(u, np.uint32(3)), (x,))) == 2
    # the write's claim scatter-max: dynamic (row, col) indices, constant updates below 2**31, donated
    words = sample("uint32", (61, 12), np.random.default_rng(17))
    words[::2] |= np.uint32(2**31)
    dest = np.array([[r % 63, 3] for r in range(0, 64, 4)], np.int32)  # rows 61, 62 dropped
    upd = np.arange(1, 17, dtype=np.uint32)
    smax = lambda w, d, u: lax.scatter_max(w, d, u, SCATTER_DNS["elt"], mode="drop")  # noqa: E731
    assert len(_ops(smax, (words, dest, upd), consts=(2,), donate=True)) <= 11


def test_compile_rule_builds_on_its_device_and_refuses_as_rule_for():
    closed = jax.make_jaxpr(lambda: lax.broadcasted_iota(jnp.int32, (2, 3), 1))()
    (e,) = closed.jaxpr.eqns
    (out,) = prims.compile_rule(e, "meta", {})([], ())
    assert out.device.type == "meta" and tuple(out.shape) == (2, 3)
    (out,) = prims.compile_rule(e, torch.device("cpu"))([], ())
    assert out.tolist() == [[0, 1, 2]] * 2
    mm = jax.make_jaxpr(lambda a, b: a @ b)(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))
    with pytest.raises(prims.UnsupportedPrimitive, match="no torch rule for primitive 'dot_general'"):
        prims.compile_rule(mm.jaxpr.eqns[0], "cpu", {})


VIEW_CHAINS = [  # (chain, input dtype, shape): the write / verify launches' view runs, and harder ones
    (lambda b: lax.bitcast_convert_type(b.reshape(61, 12, 4), jnp.uint32), "uint8", (61, 48)),
    (lambda w: lax.bitcast_convert_type(w, jnp.uint8).reshape(61, 48), "uint32", (61, 12)),
    (lambda w: lax.broadcast_in_dim(lax.squeeze(lax.slice(w, (2, 0), (3, 2)), (0,)), (1, 2), (1,)), "uint32", (12, 2)),
    (lambda w: lax.convert_element_type(w, jnp.int32).reshape(24), "uint32", (12, 2)),
    (lambda w: lax.broadcast_in_dim(lax.slice(w, (0, 1), (12, 2)), (3, 12, 1), (1, 2)), "uint32", (12, 2)),
    (lambda w: lax.transpose(lax.slice(w, (1, 0), (5, 2)), (1, 0)).reshape(8), "uint32", (12, 2)),  # copies
    (lambda w: lax.bitcast_convert_type(lax.slice(w, (1, 0), (5, 2)), jnp.uint16).reshape(4, 4), "uint32", (12, 2)),
    (lambda h: lax.bitcast_convert_type(h.reshape(3, 4, 2), jnp.float32), "bfloat16", (3, 8)),
]


@pytest.mark.parametrize("case", range(len(VIEW_CHAINS)))
def test_view_chains_in_one_call(case):
    """``compile_view_chain``: XLA's bytes on contiguous, offset and strided inputs; one or two calls (and shared
    memory) on a contiguous input; the step-by-step path otherwise."""
    fn, dtype, shape = VIEW_CHAINS[case]
    x = sample(dtype, shape, np.random.default_rng(18 + case))
    closed = jax.make_jaxpr(fn)(x)
    eqns = closed.jaxpr.eqns
    assert all(prims_views.is_view(e) for e in eqns), [e.primitive.name for e in eqns]
    (want,) = jax.jit(jcore.jaxpr_as_fun(closed))(x)
    run = prims_views.compile_view_chain(eqns, "cpu")
    t = prims.from_numpy(x, "cpu")
    big = prims.from_numpy(np.concatenate([x, x, x]), "cpu")
    holders = {"contiguous": t, "offset": big[len(x) : 2 * len(x)], "strided": torch.stack([t, t], -1)[..., 1]}
    for how, arg in holders.items():
        assert arg.is_contiguous() == (how != "strided")
        with _CountOps() as c:
            (out,) = run([arg], (False,))
        assert _same(np.asarray(want), prims.to_numpy(out, closed.jaxpr.outvars[0].aval.dtype)), how
        if how != "strided" and case != 5:
            assert len(c.ops) <= 2 and out.untyped_storage().data_ptr() == arg.untyped_storage().data_ptr(), c.ops
    b = prims.from_numpy(sample("uint8", (1, 61 * 48 + 1), np.random.default_rng(1)), "cpu")[0, 1:].reshape(61, 48)
    if case == 0:  # an offset the word size does not divide: the dtype view refuses, the rules copy
        (out,) = run([b], (False,))
        assert prims.to_numpy(out, np.uint32).tobytes() == prims.to_numpy(b, np.uint8).tobytes()


def test_view_chain_refusals():
    u = np.zeros((4, 6), np.uint32)
    closed = jax.make_jaxpr(lambda u: [lax.reshape(u, (24,), dimensions=(1, 0)), u.astype(jnp.float32), u + 1,
                                       u.reshape(6, 4), u.astype(jnp.int32)])(u)  # fmt: skip
    views = [prims_views.is_view(e) for e in closed.jaxpr.eqns]
    assert views == [False, False, False, True, True], closed
    with pytest.raises(ValueError, match="not a chain of views"):
        prims_views.compile_view_chain(closed.jaxpr.eqns[:2], "cpu")
    reshape, convert = closed.jaxpr.eqns[-2:]
    with pytest.raises(ValueError, match="cannot read reshape's output"):
        prims_views.compile_view_chain([reshape, convert], "cpu")
