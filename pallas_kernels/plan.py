"""Pallas plan build, ``canary_plan``: SGLang's ``launch_canary_plan_kernels`` (SPEC 7) as one kernel launch.

:func:`build_plans_pallas` is the ``pallas`` backend of :func:`canary_jax.ops.plan_launch.build_plans`: the same
``(VerifyPlan, WritePlan)`` as the jnp builder, bit for bit, with ``jax_enable_x64`` off and on, fresh or over old
plans (``*_plan_out``, aliased: what SGLang leaves untouched keeps its bytes).
The jnp builder needs about 15 XLA kernels (a scan, a search, gathers, pads, a select per field); this is one
``pallas_call`` over a persistent grid of ``PallasConfig.plan_max_programs`` programs:

1. every program loads the batch's rows (``bs`` lanes, padded to a power of 2), computes each row's verify count
   (``min(P, C + 1)``, the SWA window, padding rows and ``P <= 0`` give 0) and their inclusive cumsum, and
   stores the cumsum to a scratch output that the binary search reads (all programs store the same values; a
   block barrier makes a program's own stores visible to its threads);
2. every program walks blocks of ``plan_block`` verify entries. Entry ``i < total`` (when the plan does not
   overflow) finds its row by a binary search of the cumsum, verifies position ``P - incl[r] + i`` and gathers
   its slot, its predecessor's slot (``-1`` at position 0) and, with the pool, its expected token; the SWA LUT
   translates both slots. A fresh plan stores every entry, dead ones (and all of them on overflow) as 0;
   over an old plan only the live entries are stored;
3. program 0 stores ``num_valid`` / ``enable``, the write offsets (exclusive cumsum of the live rows' extends,
   exact in 64 bits) and each row's seed slot.

Supported launches: the tables of :mod:`pallas_kernels.plan_tables`, ``1 <= bs < 32768`` and
``bs * (C + 1) < 2**32`` (the count cumsum is exact in uint32). :func:`build_plans_pallas` returns None for any
other, and the builder runs its jnp path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from canary_jax.contract import pairs, validation
from canary_jax.contract.pairs import U64
from canary_jax.planning.plan_inputs import PlanInputs
from canary_jax.planning.plans import VerifyPlan, WritePlan
from pallas_kernels import calls, plan_tables, refs
from pallas_kernels import config as pallas_config
from pallas_kernels.config import PallasConfig, default_interpret

I32, U32 = jnp.int32, jnp.uint32
FIELDS = ("slot", "token", "position", "prev")
_VERIFY_FIELDS = validation.VERIFY_PLAN_FIELDS[:4]  # the entry fields, in FIELDS' order

MIN_LANES = 32
"""Fewest lanes of any vector in the kernel: a one-row launch (decode batch 1) would otherwise make Triton
tensors of one element, and on the H200 (jax 0.11.2, triton 3.6) compiling those segfaulted inside XLA's GPU
compile (as the one-launch write did before its ``MIN_BLOCK``)."""


def _pow2(n: int) -> int:
    return max(1 << max(int(n) - 1, 0).bit_length(), MIN_LANES)


def _cumsum_u64(a: U64) -> U64:
    """Inclusive cumsum mod 2**64 of ``[n]`` int64 words (``n < 2**15``): 16-bit pieces of the low word keep
    their sums below 2**31, the high words wrap as they should."""
    s0 = jnp.cumsum((a.lo & 0xFFFF).astype(I32), dtype=I32).astype(U32)
    s1 = jnp.cumsum(pairs.shr32(a.lo, 16).astype(I32), dtype=I32).astype(U32)
    s2 = jnp.cumsum(jax.lax.bitcast_convert_type(a.hi, I32), dtype=I32)
    low = pairs.add(U64(s0, jnp.zeros_like(s0)), U64(pairs.shl32(s1, 16), pairs.shr32(s1, 16)))
    return U64(low.lo, low.hi + jax.lax.bitcast_convert_type(s2, U32))


def _store_pairs(ref, i: jax.Array, v: U64, mask: jax.Array) -> None:
    """Entries ``i`` of a flat ``uint32[2 n]`` pair ref get ``v`` where ``mask``: one ``[B, 2]`` store."""
    refs.store_run(ref, 2 * i, refs.from_columns([v.lo, v.hi]), jnp.broadcast_to(mask[:, None], (i.shape[0], 2)))


def _plan_kernel(
    *all_refs, names, spec, pool_spec, lut_len, bs, cap, cw, max_seq_len, block, keep_entries, keep_seeds, interpret
):
    r = dict(zip(names, all_refs))
    bsp = _pow2(bs)
    rows = refs.iota(bsp)
    in_bs = rows < bs
    rpi = refs.load_pair_flat(r["rpi"], rows, in_bs)
    prefix = refs.load_pair_flat(r["prefix"], rows, in_bs)
    w, k = r["wk"][0], r["wk"][1]
    is_pad = pairs.is_zero(rpi)
    p_pos = pairs.is_positive(prefix)

    count = pairs.clamp(prefix, cap + 1)
    count = jnp.where(w > 0, jnp.minimum(count, w), count)
    count = jnp.where(is_pad | ~p_pos | ~in_bs, 0, count)
    incl = jnp.cumsum(count, dtype=I32).astype(U32)  # exact: bs * (C + 1) < 2**32
    total = jnp.sum(count, dtype=I32).astype(U32)
    overflow = total > jnp.uint32(cap)
    live_n = jnp.where(overflow, jnp.uint32(0), total)
    refs.store_vec(r["incl"], rows, incl, in_bs)
    refs.barrier(interpret)

    def entries(b):
        i = b * block + refs.iota(block)
        live = i.astype(U32) < live_n
        # searchsorted(incl, i, side="right"): the first row whose inclusive count passes i.
        lo, hi = jnp.zeros_like(i), jnp.full_like(i, bs)
        for _ in range(bs.bit_length()):
            act = lo < hi
            mid = jax.lax.shift_right_logical(lo + hi, jnp.int32(1))
            go = refs.load_vec(r["incl"], mid, act & live, 0) <= i.astype(U32)
            lo = jnp.where(act & go, mid + 1, lo)
            hi = jnp.where(act & ~go, mid, hi)
        row = jnp.minimum(lo, bs - 1)
        base = pairs.sub(
            refs.load_pair_flat(r["prefix"], row, live),
            U64(refs.load_vec(r["incl"], row, live, 0), jnp.zeros_like(i, U32)),
        )
        pos = pairs.add(base, U64(i.astype(U32), jnp.zeros_like(i, U32)))
        row_rpi = refs.load_pair_flat(r["rpi"], row, live)
        slot = plan_tables.translate(r.get("lut"), lut_len, plan_tables.lookup(spec, r, row, row_rpi, pos, live), live)
        before = pairs.sub(pos, pairs.const(1, i.shape))
        prev = plan_tables.translate(
            r.get("lut"), lut_len, plan_tables.lookup(spec, r, row, row_rpi, before, live), live
        )
        prev = pairs.where(pairs.is_zero(pos), pairs.const(-1, i.shape), prev)
        if pool_spec is None:
            tok = pairs.const(-1, i.shape)
        else:
            col = pairs.add(pos, pairs.from_int32(jnp.broadcast_to(k, i.shape)))
            valid = refs.load_pair_flat(r["valid"], row, live)
            want = ~pairs.is_negative(col) & pairs.lt(col, valid)
            t, t_ok = plan_tables.pool_token(pool_spec, r, row, row_rpi, col, live & want)
            tok = pairs.from_int32(jnp.where(want & t_ok, t, -1))
        if keep_entries:  # the old plan's entries (aliased) stay where SGLang leaves them: only live ones move
            for name, v in zip(FIELDS, (slot, tok, pos, prev)):
                _store_pairs(r[name], i, v, live)
        else:  # a fresh plan: every entry, the dead ones 0
            zero = pairs.const(0, i.shape)
            for name, v in zip(FIELDS, (slot, tok, pos, prev)):
                _store_pairs(r[name], i, pairs.where(live, v, zero), i < cap)

    refs.for_each_block(refs.cdiv(cap, block), entries)

    @pl.when(refs.program_id() == 0)
    def _write_meta():
        r["num_valid"][0] = jnp.where(overflow, jnp.uint32(cap), total).astype(I32)
        r["enable"][0] = jnp.where(overflow, 0, 1).astype(I32)
        extend = refs.load_pair_flat(r["extend"], rows, in_bs)
        e_pos = pairs.is_positive(extend)
        wlen = pairs.where(is_pad | ~e_pos | ~in_bs, pairs.const(0, rows.shape), extend)
        _store_pairs(r["offsets"], rows + 1, _cumsum_u64(wlen), in_bs)
        j = refs.iota(_pow2(cw + 1))
        _store_pairs(r["offsets"], j, pairs.const(0, j.shape), (j == 0) | ((j > bs) & (j <= cw)))
        seed_col = pairs.clamp(pairs.sub(prefix, pairs.const(1, rows.shape)), max(max_seq_len - 1, 0))
        seed = plan_tables.lookup(spec, r, rows, rpi, pairs.from_int32(seed_col), in_bs)
        seed = plan_tables.translate(r.get("lut"), lut_len, seed, in_bs)
        seed = pairs.where(is_pad | ~e_pos | ~p_pos, pairs.const(-1, rows.shape), seed)
        _store_pairs(r["seeds"], rows, seed, in_bs)
        if not keep_seeds:  # a fresh plan's seeds past bs are 0; an old plan's keep their bytes
            js = refs.iota(_pow2(cw))
            _store_pairs(r["seeds"], js, pairs.const(0, js.shape), (js >= bs) & (js < cw))


@functools.partial(jax.jit, static_argnames=("cap", "cw", "interpret", "config"))
def _plans(verify_out, write_out, rpi, prefix, extend, table, lut, pool, valid, wk, *, cap, cw, interpret, config):
    bs = int(rpi.shape[0])
    spec, table_ops = plan_tables.table_operands(table)
    args = {"rpi": rpi.reshape(-1), "prefix": prefix.reshape(-1), "extend": extend.reshape(-1), "wk": wk, **table_ops}
    if verify_out is not None:  # outputs named as inputs alias them (calls.call)
        args.update(zip(FIELDS, (getattr(verify_out, f).reshape(-1) for f in _VERIFY_FIELDS)))
    if write_out is not None:
        args["seeds"] = write_out.write_seed_slot_indices.reshape(-1)
    pool_spec = None
    if pool is not None:
        pool_spec, pool_ops = plan_tables.pool_operands(pool)
        args.update(pool_ops, valid=valid.reshape(-1))
    if lut is not None:
        args["lut"] = lut.reshape(-1)
    sds = jax.ShapeDtypeStruct
    out = {name: sds((2 * cap,), U32) for name in FIELDS}
    out.update(
        num_valid=sds((1,), I32),
        enable=sds((1,), I32),
        offsets=sds((2 * (cw + 1),), U32),
        seeds=sds((2 * cw,), U32),
        incl=sds((_pow2(bs),), U32),
    )
    kernel = functools.partial(
        _plan_kernel,
        names=(*args, *out),
        spec=spec,
        pool_spec=pool_spec,
        lut_len=None if lut is None else int(lut.shape[0]),
        bs=bs,
        cap=cap,
        cw=cw,
        max_seq_len=table.max_seq_len,
        block=max(config.plan_block, MIN_LANES),
        keep_entries=verify_out is not None,
        keep_seeds=write_out is not None,
        interpret=interpret,
    )
    grid = (max(1, min(-(-cap // max(config.plan_block, MIN_LANES)), config.plan_max_programs)),)
    params = pltriton.CompilerParams(num_warps=config.plan_num_warps, num_stages=1)
    res = dict(
        zip(
            out,
            calls.call(kernel, args, out, grid=grid, compiler_params=params, interpret=interpret, name="canary_plan"),
        )
    )
    verify = VerifyPlan(
        **{f: res[name].reshape(cap, 2) for f, name in zip(_VERIFY_FIELDS, FIELDS)},
        verify_num_valid=res["num_valid"],
        enable=res["enable"],
    )
    write = WritePlan(
        write_offsets=res["offsets"].reshape(cw + 1, 2),
        write_seed_slot_indices=res["seeds"].reshape(cw, 2),
        write_num_valid_reqs=np.full((1,), bs, np.int32),  # a constant: no broadcast kernel
    )
    return verify, write


def supports(table, lut, pool, *, bs: int, cap: int) -> bool:
    """Whether :func:`build_plans_pallas` runs this launch (see the module docstring)."""
    return (
        1 <= bs < 2**15
        and bs * (cap + 1) < 2**32
        and plan_tables.table_operands(table) is not None
        and (pool is None or plan_tables.pool_operands(pool) is not None)
        and (lut is None or lut.shape[0] > 0)
    )


def build_plans_pallas(
    inputs: PlanInputs, *, interpret: bool | None = None, config: PallasConfig | None = None
) -> tuple[VerifyPlan, WritePlan] | None:
    """One group's ``(VerifyPlan, WritePlan)`` in one kernel launch, or None when not :func:`supports`-ed.

    Args:
      inputs: the launch as :func:`canary_jax.planning.plan_inputs.check_plan_inputs` checked it. Old plans
        (``verify_out`` / ``write_out``) keep their bytes where SGLang leaves its in-place outputs untouched
        (entries past ``num_valid``, all of them on overflow, seeds past ``bs``); None = fresh plans, those
        regions 0.
      interpret: None decides from JAX's default backend (compiled on a GPU).
      config: the tuning knobs (None: ``pallas_kernels.config.DEFAULT_CONFIG``, read per call).

    Returns:
      ``(VerifyPlan, WritePlan)`` equal to :func:`canary_jax.planning.plan_builder.build_plans`' bytes, or None.
    """
    if not supports(inputs.table, inputs.lut, inputs.pool, bs=int(inputs.rpi.shape[0]), cap=inputs.cap):
        return None
    interpret = default_interpret(None) if interpret is None else bool(interpret)
    # the window and k are static ints of the launch (check_plan_inputs): a constant operand, no kernel to build it
    wk = np.array([int(inputs.w), int(inputs.k)], np.int32)
    config = config or pallas_config.DEFAULT_CONFIG  # read per call, as config.launch_options does
    return _plans(*inputs[:9], wk, cap=inputs.cap, cw=inputs.cw, interpret=interpret, config=config)
