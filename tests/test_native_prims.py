"""interop.native.prims: every torch rule against XLA:CPU, bit for bit.

Each case traces a small function with ``jax.make_jaxpr`` over edge-valued inputs (0, 1, -1, INT_MIN, INT_MAX,
2**31, 2**32-1, shifts past the width, out-of-range and duplicate gather / scatter indices, NaN and -0), runs the
jaxpr equation by equation (the evaluator of ``tests/helpers/native_prims_harness.py``, inlining calls and running
``scan`` / ``while`` / ``cond`` on the host) three ways: through :data:`prims.RULES`; through
:func:`prims.compile_rule` with only the literals constant; and through ``compile_rule`` with every input that is
not donated passed as a constant (so gathers and scatters take their precomputed constant-index paths, out-of-range
and duplicate indices included). Each way's outputs are compared byte for byte with the jitted jaxpr on XLA:CPU. The
jaxprs run once more on torch's ``meta`` device (rules and compiled), which has no values: a rule that read one back
to the host (``.item()``, ``nonzero``, boolean indexing) or made a shape from one would fail there. The strongest
case runs whole plan / verify / write launch bodies captured from real SGLang-shaped launches, with x64 off and on.

The compiled forms' own properties (every constant subset, op counts, view chains, in-place donation) are
``tests/test_native_prims_compiled.py``'s.
"""

from __future__ import annotations

import collections
import random

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from jax import lax
from jax._src.lax import lax as lax_internal

from helpers.native_prims_harness import (
    BAD_ROWS,
    COVERED,
    FLOATS,
    INLINE,
    INTS,
    MODES,
    WAYS,
    Evaluator,
    _bytes,
    check,
    kind,
    pair,
    run_ways,
    sample,
)
from interop.native import prims


# --- dtypes ---------------------------------------------------------------------------------------------------
def test_storage_dtypes_and_bit_exact_round_trips():
    want = {
        "bool": torch.bool, "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "uint16": torch.int16,
        "int32": torch.int32, "uint32": torch.int32, "int64": torch.int64, "uint64": torch.int64,
        "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64,
    }  # fmt: skip
    rng = np.random.default_rng(0)
    for name, st in want.items():
        dt = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
        assert prims.storage_dtype(dt) == st
        assert prims.storage_dtype(jnp.dtype(name)) == st
        a = (
            sample(dt, (3, 5), rng)
            if name not in ("int64", "uint64", "float64")
            else (np.arange(15) - 7).astype(dt).reshape(3, 5)
        )
        t = prims.from_numpy(a, "cpu")
        assert t.dtype == st and tuple(t.shape) == (3, 5)
        back = prims.to_numpy(t, dt)
        assert back.dtype == dt and np.array_equal(_bytes(back), _bytes(a))
        s = prims.constant(a.reshape(-1)[4], dt, "cpu")  # a 0-d literal
        assert s.shape == () and np.array_equal(_bytes(prims.to_numpy(s, dt)), _bytes(a.reshape(-1)[4:5]))
    assert prims.to_numpy(prims.constant(2**32 - 1, np.uint32, "cpu"), np.uint32) == 2**32 - 1
    assert prims.constant(2**32 - 1, np.uint32, "cpu").item() == -1  # the bit pattern in int32 storage
    for bad in (np.complex64, ml_dtypes.float8_e4m3fn, ml_dtypes.int4):
        with pytest.raises(TypeError, match="no torch storage dtype"):
            prims.storage_dtype(bad)
    with pytest.raises(TypeError, match="stored as torch.int32, got torch.int64"):
        prims.to_numpy(torch.zeros(2, dtype=torch.int64), np.uint32)


def test_unsupported_primitive_and_params_are_named():
    closed = jax.make_jaxpr(lambda a, b: a @ b)(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32))
    with pytest.raises(prims.UnsupportedPrimitive, match="no torch rule for primitive 'dot_general'"):
        prims.rule_for(closed.jaxpr.eqns[0])
    assert issubclass(prims.UnsupportedPrimitive, NotImplementedError)
    dn = lax.GatherDimensionNumbers(
        offset_dims=(), collapsed_slice_dims=(1,), start_index_map=(1,), operand_batching_dims=(0,),
        start_indices_batching_dims=(0,),
    )  # fmt: skip
    g = jax.make_jaxpr(lambda x, i: lax.gather(x, i, dn, (1, 1)))(np.ones((3, 4), np.int32), np.zeros((3, 1), np.int32))
    with pytest.raises(prims.UnsupportedPrimitive, match=r"'gather' with operand_batching_dims=\(0,\)"):
        prims.rule_for(g.jaxpr.eqns[0])
    sdn = lax.ScatterDimensionNumbers(
        update_window_dims=(), inserted_window_dims=(1,), scatter_dims_to_operand_dims=(1,),
        operand_batching_dims=(0,), scatter_indices_batching_dims=(0,),
    )  # fmt: skip
    s = jax.make_jaxpr(lambda x, i, u: lax.scatter_add(x, i, u, sdn))(
        np.ones((3, 4), np.int32), np.zeros((3, 1), np.int32), np.ones((3,), np.int32)
    )
    with pytest.raises(prims.UnsupportedPrimitive, match=r"'scatter-add' with operand_batching_dims=\(0,\)"):
        prims.rule_for(s.jaxpr.eqns[0])
    a = jax.make_jaxpr(lambda x: x.at[1].apply(lambda v: v * 2))(np.zeros(3, np.int32))
    (eqn,) = [e for e in a.jaxpr.eqns if e.primitive.name == "scatter"]
    with pytest.raises(prims.UnsupportedPrimitive, match=r"'scatter' with update_jaxpr \(a scatter_apply"):
        prims.rule_for(eqn)
    c = jax.make_jaxpr(lambda a: a + a)(np.ones(2, np.complex64))
    with pytest.raises(prims.UnsupportedPrimitive, match="'add' on dtype complex64"):
        prims.rule_for(c.jaxpr.eqns[0])
    for name in INLINE + ("scan", "while", "cond", "pallas_call"):
        assert name not in prims.RULES  # the executor's


# --- elementwise ----------------------------------------------------------------------------------------------
def _lt_to(a, b):
    return lax_internal.lt_to_p.bind(a, b)


def _binary_ops(a, b):
    outs = [a + b, a - b, a * b, lax.max(a, b), lax.min(a, b), a == b, a != b, a < b, a <= b, a > b, a >= b]
    outs += [_lt_to(a, b), lax_internal.le_to_p.bind(a, b), lax_internal.eq_to_p.bind(a, b)]
    outs += [lax.clamp(jnp.minimum(a, b), a, jnp.maximum(a, b)), lax.select(a < b, a, b), lax.neg(a)]
    outs += [lax.sign(a), lax.square(a), a + lax.full_like(a, 1)]
    if not jnp.issubdtype(a.dtype, jnp.unsignedinteger):
        outs.append(lax.abs(a))
    if jnp.issubdtype(a.dtype, jnp.integer):
        outs += [lax.div(a, b), lax.rem(a, b), a & b, a | b, a ^ b, ~a]
        outs += [lax.shift_left(a, b), lax.shift_right_logical(a, b), lax.shift_right_arithmetic(a, b)]
        outs += [lax.population_count(a), lax.clz(a), lax.integer_pow(a, 3), lax.integer_pow(a, 0)]
        for k in (0, 1, 7, 8, 15, 16, 31, 32, 33):  # literal amounts take a two-op path
            outs += [lax.shift_right_logical(a, jnp.asarray(k, a.dtype)), a >> jnp.asarray(k, a.dtype)]
    else:
        outs += [a / b, lax.rem(a, b)]
    return outs


@pytest.mark.parametrize("dtype", INTS + FLOATS)
def test_elementwise_bits(dtype):
    a, b = pair(dtype, 64, np.random.default_rng(1))
    check(_binary_ops, a, b)


def test_elementwise_bool():
    a = np.array([False, False, True, True] * 3)
    b = np.array([False, True, False, True] * 3)
    check(lambda a, b: [a & b, a | b, a ^ b, ~a, a == b, a != b, a < b, a >= b, lax.max(a, b), lax.min(a, b),
                        lax.select(a, a, b), a.astype(jnp.int32), a.astype(jnp.uint32), a.astype(jnp.float32)],
          a, b)  # fmt: skip


def test_select_n_with_an_index_predicate_and_scalar_broadcasts():
    rng = np.random.default_rng(2)
    c = [sample("uint32", (12,), rng) for _ in range(3)]
    which = np.arange(12, dtype=np.int32) % 3
    check(lambda w, x, y, z, s: [lax.select_n(w, x, y, z), lax.select_n(w < 1, x, y), lax.select_n(s, x, y),
                                 lax.select_n(w < 2, x)], which, *c, np.bool_(True))  # fmt: skip
    check(lambda x, s: [jnp.where(x > s, x, s), lax.max(x, s), x >> s], c[0], np.uint32(3))


def test_integer_pow_and_float_unary_best_effort():
    x = np.array([0.5, -1.5, 2.0, 3.25, -0.0, np.inf, 7.5], np.float32)
    check(lambda x: [lax.integer_pow(x, y) for y in (-3, -1, 1, 2, 3, 5, 9)], x)
    y = np.array([0.5, 1.5, 2.0, 3.25, 0.1, 10.0, 2.5, -2.5, -0.5], np.float32)
    check(lambda x: [jnp.floor(x), jnp.ceil(x), jnp.round(x), lax.round(x, lax.RoundingMethod.AWAY_FROM_ZERO),
                     jnp.isfinite(x)], y)  # fmt: skip
    check(lambda x: [jnp.exp(x), jnp.log(jnp.abs(x)), jnp.sqrt(jnp.abs(x)), jnp.tanh(x), jax.nn.sigmoid(x),
                     lax.rsqrt(jnp.abs(x)), jnp.sin(x), jnp.cos(x), jnp.expm1(x), jnp.log1p(jnp.abs(x)),
                     jnp.exp2(x), lax.pow(jnp.abs(x), x), jnp.arctan2(x, x + 1)], y, exact=False)  # fmt: skip


CONVERT_TO = ["bool", *INTS, "float32", "float16", "bfloat16"]


@pytest.mark.parametrize("src", ["bool", *INTS, "float32", "bfloat16"])
def test_convert_element_type(src):
    x = sample(src, (96,), np.random.default_rng(3))
    if kind(np.dtype(src)) == "f":  # saturation, NaN -> 0, truncation toward zero
        x = np.concatenate([x, np.array([2.0**31, -(2.0**31), 2.0**32, 1e10, -1e10, 255.5, 256.0, -0.7], x.dtype)])
    check(lambda x: [lax.convert_element_type(x, jnp.dtype(d)) for d in CONVERT_TO], x)


def test_bitcast_convert_type_and_views():
    rng = np.random.default_rng(4)
    b = sample("uint8", (6, 8), rng)
    u = sample("uint32", (6, 2), rng)
    f = sample("float32", (6,), rng)
    bc = lax.bitcast_convert_type
    ev = check(
        lambda b, u, f: [bc(b.reshape(6, 2, 4), jnp.uint32), bc(u, jnp.uint8), bc(u, jnp.int32), bc(u, jnp.float32),
                         bc(f, jnp.uint16), bc(b.reshape(6, 4, 2), jnp.bfloat16), bc(u[:, ::2], jnp.uint8)],
        b, u, f,
    )  # fmt: skip
    assert ev.counts["bitcast_convert_type"] == 7
    # views come back as views of the input, no copy
    closed = jax.make_jaxpr(
        lambda u: [lax.bitcast_convert_type(u, jnp.int32), u.astype(jnp.int32), u.reshape(12), u[None],
                   jnp.broadcast_to(u, (3, 6, 2)), u[1:4], u.T, lax.bitcast_convert_type(u, jnp.uint8)]
    )(u)  # fmt: skip
    t = prims.from_numpy(u, "cpu")
    outs = Evaluator().run(closed, [t])
    assert all(o.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for o in outs)


def test_x64_integers():
    with jax.enable_x64(True):
        rng = np.random.default_rng(5)
        for dtype in ("int64", "uint64"):
            a, b = pair(dtype, 48, rng)
            check(_binary_ops, a, b)
            check(lambda x: [x.astype(jnp.dtype(d)) for d in ("int32", "uint32", "uint8", "float64", "float32",
                                                               "int64", "uint64", "bool")], a)  # fmt: skip
        f = np.array([np.nan, 2.0**63, -(2.0**63), 2.0**64, 1e30, -1e30, 2.0**63 - 1024, 3.9, -3.9, 2.0**64 - 2048])
        check(lambda x: [x.astype(jnp.int64), x.astype(jnp.uint64), x.astype(jnp.uint32)], f)
        u32 = sample("uint32", (32,), rng)
        check(lambda x: [x.astype(jnp.int64), x.astype(jnp.uint64), x.astype(jnp.float64)], u32)
        # 64-bit indices: FILL_OR_DROP gathers wrap them to int32 first (jax's lowering), the rest do not
        x = sample("uint64", (6, 3), rng)
        rows = np.array([0, 5, 6, -1, 2**32 + 3, -(2**32) + 1, 2**62, -(2**63)], np.int64)
        dn = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
        sdn = lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                          scatter_dims_to_operand_dims=(0,))  # fmt: skip
        upd = sample("uint64", (8, 3), rng)
        for idx in (rows, rows.astype(np.uint64)):
            check(lambda x, r, u: [*(lax.gather(x, r[:, None], dn, (1, 3), mode=m) for m in MODES),
                                   *(f(x, r[:, None], u, sdn, mode=m) for m in MODES
                                     for f in (lax.scatter, lax.scatter_max, lax.scatter_add)),
                                   lax.dynamic_slice_p.bind(x, r[4], r[1], slice_sizes=(2, 2)),
                                   lax.dynamic_update_slice_p.bind(x, u[:2, :2], r[4], r[6]),
                                   *lax.sort((x[:, 0], r[:6]), num_keys=1), jnp.sort(r), jnp.argmax(x, 0),
                                   jnp.max(x, 1), lax.cummin(x, 0), jnp.sum(x, 0)],
                  x, idx, upd)  # fmt: skip


# --- shapes ---------------------------------------------------------------------------------------------------
def test_shape_ops():
    rng = np.random.default_rng(6)
    x = sample("uint32", (4, 6), rng)
    y = sample("uint32", (4, 3), rng)
    check(
        lambda x, y: [x.reshape(2, 12), x.reshape(24)[None, :, None].squeeze((0, 2)), jnp.expand_dims(x, 1), x.T,
                      lax.broadcast_in_dim(x[:, :1], (4, 5, 6), (0, 2)), x[1:4:2, ::3], x[::-1, ::-2],
                      jnp.concatenate([x, y], 1), jnp.stack([x, x + 1], 1), *jnp.split(x, [1, 4], axis=1),
                      lax.iota(jnp.int32, 7), lax.broadcasted_iota(jnp.uint8, (3, 5), 1), jnp.tile(y, (2, 1)),
                      lax.rev(x, (0, 1)), lax.reshape(x, (6, 4), dimensions=(1, 0)), jnp.arange(5.0),
                      *lax.unstack(y, axis=1)],
        x, y,
    )  # fmt: skip


def test_pad_negative_and_interior():
    x = np.arange(1, 13, dtype=np.int32).reshape(3, 4)
    configs = [((1, 2, 0), (0, 0, 0)), ((-1, 1, 1), (2, -3, 2)), ((0, -2, 0), (-1, -1, 0)), ((2, -4, 3), (1, 0, 1))]
    check(
        lambda x, v: [lax.pad(x, v, c) for c in configs] + [lax.pad(x[:0], v, ((1, 1, 2), (0, 1, 0)))], x, np.int32(-9)
    )
    check(lambda x: lax.pad(x, jnp.float32(np.nan), ((1, 0, 1),)), np.array([1.0, -0.0, 2.0], np.float32))


def test_dynamic_slice_and_update_slice():
    rng = np.random.default_rng(7)
    x = sample("int32", (6, 5), rng)
    u = sample("int32", (2, 3), rng)
    for i, j in [(0, 0), (5, 4), (-1, 2), (2**31 - 1, -(2**31)), (3, 1)]:
        si, sj = np.int32(i), np.int32(j)
        check(lambda x, u, i, j: [lax.dynamic_slice_p.bind(x, i, j, slice_sizes=(2, 3)),
                                  lax.dynamic_update_slice_p.bind(x, u, i, j),
                                  lax.dynamic_slice_p.bind(x, np.int32(4), j, slice_sizes=(2, 3))],
              x, u, si, sj)  # fmt: skip
    for i in [0, 1, 2**31, 2**32 - 1, 5]:  # unsigned starts clamp as unsigned
        check(lambda x, u, i: [lax.dynamic_slice_p.bind(x, i, i, slice_sizes=(2, 3)),
                               lax.dynamic_update_slice_p.bind(x, u, i, np.uint32(1))], x, u, np.uint32(i))  # fmt: skip
    check(lambda x, u: [lax.dynamic_update_slice(x, u, (1, 9)), lax.dynamic_slice(x, (9, 1), (2, 3))], x, u)


# --- gather / scatter -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("idt", ["int32", "uint32"])
def test_gather(mode, idt):
    rng = np.random.default_rng(8)
    x = sample("uint32", (6, 4), rng)
    rows = np.array(BAD_ROWS, dtype=np.int64).astype(idt)
    cols = np.array([0, 1, 3, 4, -1, 2, 2, 9, 1, 0], dtype=np.int64).astype(idt)
    row_dn = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
    elt_dn = lax.GatherDimensionNumbers(offset_dims=(), collapsed_slice_dims=(0, 1), start_index_map=(0, 1))
    win_dn = lax.GatherDimensionNumbers(offset_dims=(0, 2), collapsed_slice_dims=(), start_index_map=(1, 0))
    col_dn = lax.GatherDimensionNumbers(offset_dims=(0,), collapsed_slice_dims=(1,), start_index_map=(1,))

    def f(x, r, c):
        g = lambda i, dn, s, **kw: lax.gather(x, i, dn, s, mode=mode, **kw)  # noqa: E731
        return [
            g(r[:, None], row_dn, (1, 4)),
            g(jnp.stack([r, c], 1), elt_dn, (1, 1)),
            g(jnp.stack([c, r], 1).reshape(5, 2, 2), win_dn, (2, 3)),
            g(c[:, None], col_dn, (6, 1)),
            g(r[:, None], row_dn, (1, 2), fill_value=7),
            g(r[:0, None], row_dn, (1, 4)),
        ]

    check(f, x, rows, cols)
    f32 = sample("float32", (6, 3), rng)
    check(lambda x, r: [lax.gather(x, r[:, None], row_dn, (1, 3), mode=mode)], f32, rows)


def test_gather_jnp_indexing():
    rng = np.random.default_rng(9)
    x = sample("int8", (5, 7), rng)
    i = np.array([0, -1, 4, 7, -6, 2], np.int32)
    check(lambda x, i: [x[i], x[:, i], x[i, i % 7], jnp.take(x, i, axis=1, mode="fill", fill_value=-3),
                        x.at[i].get(mode="fill"), jnp.take(x, i, axis=0, mode="clip")], x, i)  # fmt: skip
    b = np.array([True, False, True, True, False])
    check(lambda b, i: [b.at[i].get(mode="fill"), b[i % 5]], b, i)


def _scatter_args(rng, dtype):
    x = sample(dtype, (6, 4), rng)
    rows = np.array(BAD_ROWS + [3, 3], np.int32)
    upd = sample(dtype, (12, 4), rng)
    return x, rows, upd


@pytest.mark.parametrize("dtype", ["int32", "uint32", "uint8", "int16", "float32", "bool"])
def test_scatter_family(dtype):
    rng = np.random.default_rng(10)
    x, rows, upd = _scatter_args(rng, dtype)
    row_dn = lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                         scatter_dims_to_operand_dims=(0,))  # fmt: skip
    elt_dn = lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=(0, 1),
                                         scatter_dims_to_operand_dims=(0, 1))  # fmt: skip
    win_dn = lax.ScatterDimensionNumbers(update_window_dims=(1, 2), inserted_window_dims=(),
                                         scatter_dims_to_operand_dims=(1, 0))  # fmt: skip
    fns = [lax.scatter, lax.scatter_max, lax.scatter_min]
    if dtype != "bool":  # jax has no add / mul / sub scatter on bool
        fns += [lax.scatter_add, lax.scatter_mul, lax.scatter_sub]

    def f(x, r, u):
        outs = []
        cols = (r * 3) % 5
        for fn in fns:
            for mode in MODES:
                outs.append(fn(x, r[:, None], u, row_dn, mode=mode))
                outs.append(fn(x, jnp.stack([r, cols], 1), u[:, 0], elt_dn, mode=mode))
                outs.append(fn(x, jnp.stack([cols, r], 1)[:6], u[:6, :2].reshape(6, 2, 1), win_dn, mode=mode))
            outs.append(fn(x, r[:, None] % 6, u, row_dn, unique_indices=False, mode="clip"))
        return outs

    check(f, x, rows, upd)


def test_scatter_unsigned_indices_and_unique_promise():
    rng = np.random.default_rng(11)
    x = sample("uint32", (8, 2), rng)
    u = sample("uint32", (5, 2), rng)
    idx = np.array([2**32 - 1, 2**31, 3, 7, 0], np.uint32)
    dn = lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                     scatter_dims_to_operand_dims=(0,))  # fmt: skip
    check(lambda x, i, u: [fn(x, i[:, None], u, dn, mode=m) for fn in (lax.scatter, lax.scatter_max)
                           for m in MODES] + [lax.scatter(x, i[:, None] % 8, u, dn, unique_indices=True,
                                                           indices_are_sorted=False, mode="clip")],
          x, idx, u)  # fmt: skip
    # x.at[...] forms from our bodies: a row set, a window update with a scalar index
    check(lambda x, u: [x.at[3].set(u[0]), x.at[jnp.array([1, 1, 9])].set(u[:3], mode="drop"),
                        x.at[jnp.array([1, 1, 9])].add(u[:3]), x.at[:, 1].max(u[:, 0].sum())], x, u)  # fmt: skip


# --- sort / reductions ----------------------------------------------------------------------------------------
def test_sort():
    rng = np.random.default_rng(12)
    k = np.array([3, 1, 2**32 - 1, 1, 0, 2**31, 3, 2**31 - 1, 1], np.uint32)
    v = np.arange(9, dtype=np.int32)
    i = np.array([5, -1, 5, 0, -(2**31), 2**31 - 1, 5, 0, -1], np.int32)
    f = np.array([1.0, np.nan, -0.0, 0.0, -np.nan, -np.inf, 0.0, -0.0, 1.0], np.float32)
    b = np.array([True, False, True, False, False, True, True, False, True])
    check(lambda k, v, i, f, b: [*lax.sort((k, v), num_keys=1), *lax.sort((i, k, v), num_keys=2),
                                 *lax.sort((f, v)), *lax.sort((b, i, v), num_keys=2), jnp.argsort(f),
                                 jnp.argsort(k), jnp.sort(i), *lax.sort((v, i), num_keys=2, is_stable=True)],
          k, v, i, f, b)  # fmt: skip
    m = sample("int16", (4, 5), rng)
    check(lambda m: [jnp.sort(m, axis=0), jnp.sort(m, axis=1), jnp.argsort(m, axis=0), jnp.sort(m.astype(jnp.uint16))],
          m)  # fmt: skip


@pytest.mark.parametrize("dtype", ["int32", "uint32", "uint8", "uint16", "bool", "float32"])
def test_reductions_and_scans(dtype):
    rng = np.random.default_rng(13)
    x = sample(dtype, (3, 4, 5), rng)
    is_bool, is_float = dtype == "bool", kind(np.dtype(dtype)) == "f"

    def f(x):
        outs = [jnp.max(x, axis=1), jnp.min(x, axis=(0, 2)), lax.reduce_max_p.bind(x[:, :0], axes=(1,)),
                lax.reduce_min_p.bind(x[:0], axes=(0,)), jnp.argmax(x, axis=2), jnp.argmin(x, axis=0),
                jnp.max(x, axis=())]  # fmt: skip
        if is_bool:
            return outs + [jnp.all(x, axis=1), jnp.any(x, axis=(0, 2)), lax.reduce_xor_p.bind(x, axes=(2,))]
        outs += [lax.cummax(x, 1), lax.cummin(x, 2, reverse=True)]
        if not is_float:
            outs += [jnp.sum(x, axis=(1, 2), dtype=x.dtype), jnp.prod(x, axis=1, dtype=x.dtype), lax.cumprod(x, 0)]
            outs += [lax.cumsum(x, 2), lax.cumsum(x, 1, reverse=True)]
            outs += [lax.reduce_and_p.bind(x, axes=(1,)), lax.reduce_or_p.bind(x, axes=(0, 2)),
                     lax.reduce_xor_p.bind(x, axes=(0, 1, 2)), lax.reduce_and_p.bind(x[:, :0], axes=(1,))]  # fmt: skip
        return outs

    check(f, x)
    if is_float:
        check(
            lambda x: [jnp.sum(x, axis=2), jnp.prod(x, axis=0), lax.cumlogsumexp(x / 100, 1)], x, exact=False, rtol=1e-5
        )


# --- whole launch bodies --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def launches():
    """(op, statics, body_factory, {name: numpy value}) of real write / verify / plan launches on CPU: SGLang's
    launchers run (reference backend, so the canary state evolves) and each body's inputs are recorded."""
    from test_interop_sglang import _plan_inputs

    from helpers.interop_world import World, random_verify_plan, random_write_args
    from interop import runner, sglang

    got = []
    real = runner.run_in_place

    def capture(op, statics, body_factory, args):
        vals = {}
        for a in args:  # as the body sees them: int64 as uint32 word pairs
            t = a.tensor.detach()
            if t.dtype == torch.int64:
                vals[a.name] = t.contiguous().view(torch.int32).reshape(*t.shape, 2).numpy().view(np.uint32).copy()
            else:
                vals[a.name] = prims.to_numpy(t, {torch.bfloat16: ml_dtypes.bfloat16}.get(t.dtype, t.numpy().dtype))
        got.append((op, statics, body_factory, vals))
        real(op, statics, body_factory, args)

    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("CANARY_JAX_TORCH_PATH", raising=False)
        mp.setattr(runner, "run_in_place", capture)
        rng = random.Random(31)
        sources = ((torch.bfloat16, 1, 64, 32, 0), (torch.int64, 2, 32, 16, 0), (torch.uint8, 4, 16, 16, 16))
        w = World.make(rng, sources=sources, mode=2, stride=48)
        for _ in range(2):
            plan, kw = random_write_args(rng, w)
            sglang.launch_canary_write_kernel(context=w.context(2), plan=plan, backend="reference", **kw)
        w.buf[rng.randrange(1, 61), rng.randrange(48)] ^= 0x20  # something for verify to find
        sglang.launch_canary_verify_kernel(
            context=w.context(2), plan=random_verify_plan(rng, w), check_verify_expected_token=True,
            backend="reference",
        )  # fmt: skip
        for opts in ({}, dict(lut=True, w=5), dict(pool=True, k=1)):
            kw = _plan_inputs(rng, **opts)
            vp = sglang.VerifyPlan.allocate(verify_capacity=8).zero_for_testing_()
            wp = sglang.WritePlan.allocate(write_req_capacity=6).zero_for_testing_()
            sglang.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, verify_capacity=8, **kw)
    assert [op for op, *_ in got] == ["write", "write", "verify"] + ["plan"] * 3
    return got


def _run_launch(op, statics, factory, vals, make_ev=None):
    leaves, tree = jax.tree_util.tree_flatten(vals)
    body = factory(statics)
    closed = jax.make_jaxpr(lambda *a: body(jax.tree_util.tree_unflatten(tree, a)))(*leaves)
    ref, ours, evs = run_ways(closed, leaves, make_ev)
    for way, outs in ours.items():
        for i, (r, o) in enumerate(zip(ref, outs)):
            assert r.dtype == o.dtype and np.array_equal(_bytes(r), _bytes(o)), (way, op, statics, i)
    return evs


@pytest.mark.parametrize("x64", [False, True])
def test_launch_bodies_byte_identical_to_xla(launches, x64):
    """Whole plan / verify / write bodies (reference backend, interpret platform), thousands of equations each."""
    covered = collections.Counter()
    donated = [0] * len(WAYS)
    with jax.enable_x64(x64):
        for op, statics, factory, vals in launches:
            statics = ("reference", "cpu", *statics[2:])  # the plan's jnp builder too
            evs = _run_launch(op, statics, factory, vals)
            covered.update(evs["rules"].counts)
            donated = [d + ev.donated for d, ev in zip(donated, evs.values())]
    assert covered["scatter"] > 10 and covered["gather"] > 10 and covered["sort"] >= 2, covered
    assert sum(covered.values()) > 6000
    assert min(donated) > 0, donated  # the in-place path ran inside real bodies, every way
    COVERED.update(covered)


class PallasEvaluator(Evaluator):
    """Runs each (interpreted) ``pallas_call`` through JAX on host copies, as the executor does on CPU (once per
    equation and input bytes: every way of :data:`WAYS` feeds the kernels the same bytes)."""

    done: dict = {}

    def eqn(self, e, ins, last, k, keep):
        if e.primitive.name != "pallas_call":
            return super().eqn(e, ins, last, k, keep)
        self.counts["pallas_call"] += 1
        xs = [prims.to_numpy(a, v.aval.dtype) for a, v in zip(ins, e.invars)]
        key = (id(e), *(x.tobytes() for x in xs))
        if key not in self.done:
            self.done[key] = [np.asarray(o) for o in e.primitive.bind(*map(jnp.asarray, xs), **e.params)]
        return [prims.from_numpy(o, self.device) for o in self.done[key]]


def test_pallas_launch_glue_byte_identical_to_xla(launches, monkeypatch):
    """The Pallas backend's bodies: what surrounds the kernels (reshapes and bitcasts, the flag memset) is what the
    native path runs with these rules in production. The counters pass through as SGLang's one-row views (no
    scatter), and the slot claim is a kernel of its own (``canary_write_claim``, no scatter-max). The multi-launch
    write is pinned: the fused one has no glue."""
    config = pytest.importorskip("pallas_kernels.config")
    monkeypatch.setattr(
        config, "DEFAULT_CONFIG", config.PallasConfig(write_fused_max_tokens=0, write_fused_max_hashed=0)
    )
    op, statics, factory, vals = launches[1]  # a write: verify's glue is a subset of it
    evs = _run_launch(op, ("pallas", "cpu", *statics[2:]), factory, vals, lambda way: PallasEvaluator(way=way))
    for ev in evs.values():
        assert ev.counts["pallas_call"] >= 4, ev.counts
        # no glue updates anything in place: the counters and the claim words are the kernels' own operands
        assert ev.counts["scatter"] == ev.counts["scatter-max"] == ev.donated == 0, ev.counts


BEST_EFFORT_ONLY = {"cumlogsumexp", "erf", "tile", "optimization_barrier", "copy", "copy_p", "mulhi", "sin", "cos"}


def test_every_rule_ran():
    """Every rule ran in this module's cases (skipped when the module ran only in part)."""
    if len(COVERED) < 60:
        pytest.skip("only part of the module ran")
    missing = set(prims.RULES) - set(COVERED) - BEST_EFFORT_ONLY
    assert not missing, sorted(missing)
