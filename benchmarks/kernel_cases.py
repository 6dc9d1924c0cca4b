"""The kernel benchmark's cases: verify and write, each timed for Pallas, the jnp reference and the CUDA peer,
plus the knob probe (PallasConfig variants of a few cases).

* verify: ``args.entries`` entries over an ``args.pool``-slot pool, in request-major chains
  (``harness.verify_chains``), sources of 256-byte rows; modes NONE, PARTIAL (1 and 4 sources), ALL (1 and 4
  sources). The canary is populated first so every entry is clean.
* write: one request of ``args.long_tokens`` tokens and ``args.decode_reqs`` requests of 1 token (decode,
  seeded from already written slots); modes NONE, PARTIAL x4, ALL x1, ALL x4.

``run_verify`` / ``run_write`` fill ``results[case.id]`` with ``pallas_x64_off`` / ``pallas_x64_on`` /
``reference_*`` (``us_per_call`` and the timing info of ``harness.time_jax``), ``equal_to_reference_*``,
``peer`` and (write) ``peer_buffer_equal``, ``needed_bytes`` and ``entries``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import canary_jax
from benchmarks import harness
from benchmarks.harness import ALL, NONE, PARTIAL, ROW_BYTES, TAG, Case, Data
from canary_jax.ops import reference
from pallas_kernels.config import PallasConfig
from pallas_kernels.verify import verify_pallas
from pallas_kernels.write import write_pallas


def cases(args) -> list[Case]:
    """Every case (filtered by ``args.only``: comma-separated substrings of ids), the targeted ones first."""
    out = []
    for mode, k in ((NONE, 0), (PARTIAL, 1), (PARTIAL, 4), (ALL, 1), (ALL, 4)):
        name = "none" if mode == NONE else f"{mode.name.lower()}_x{k}"
        out.append(Case(f"verify_{name}", "verify", mode, k))
    for reqs, length in ((1, args.long_tokens), (args.decode_reqs, 1)):
        for mode, k in ((NONE, 0), (PARTIAL, 4), (ALL, 1), (ALL, 4)):
            name = "none" if mode == NONE else f"{mode.name.lower()}_x{k}"
            out.append(Case(f"write_{reqs}x{length}_{name}", "write", mode, k, reqs, length))
    if args.only:
        out = [c for c in out if any(o in c.id for o in args.only.split(","))]
    first = (
        "verify_none",
        "verify_all_x4",
        f"write_{args.decode_reqs}x1_all_x4",
        f"write_1x{args.long_tokens}_none",
        f"write_1x{args.long_tokens}_all_x4",
    )  # the targeted cases first, in case the run is cut short
    return sorted(out, key=lambda c: first.index(c.id) if c.id in first else len(first))


def _print_mode(case, tag: str, rec: dict) -> None:
    """One progress line per case and x64 mode: the Pallas time and, when measured, the reference's."""
    ref = rec.get(f"reference_{tag}")
    print(
        f"  {case.id} {tag}: pallas {rec[f'pallas_{tag}']['us_per_call']:.1f} us"
        + (f", reference {ref['us_per_call']:.1f} us" if ref is not None else ""),
        flush=True,
    )


def _record(case: Case, results: dict) -> dict:
    return results.setdefault(case.id, {"case": dataclasses.asdict(case) | {"mode": case.mode.name}})


# --- verify ------------------------------------------------------------------------------------------------
def run_verify(case: Case, data: Data, args, cfg, peer, results, x64_modes):
    e = args.entries
    slots2d, pos2d, prev2d = harness.verify_chains(data, e)
    srcs = data.sources(case.num_sources)
    buf = jnp.zeros((args.pool, 32), jnp.uint8)
    buf, _ = harness.populate(data, buf, srcs, case.mode, slots2d, pos2d, cfg)
    plan_np = dict(slots=slots2d.reshape(-1), positions=pos2d.reshape(-1), prev_slots=prev2d.reshape(-1))
    plan = canary_jax.VerifyPlan.from_entries(**plan_np)
    tensors = tuple(s.tensor for s in srcs)
    rec = _record(case, results)
    rec["needed_bytes"] = harness.needed_bytes(case, args)
    rec["entries"] = e

    def step_pallas(log, c):
        ctx = harness.make_context(c[0], log, harness.with_tensors(srcs, c[2]), case.mode)
        return verify_pallas(ctx, c[1], config=cfg).log

    def step_ref(log, c):
        ctx = harness.make_context(c[0], log, harness.with_tensors(srcs, c[2]), case.mode)
        return reference.verify_reference(ctx, c[1]).log

    for x64 in x64_modes:
        jax.config.update("jax_enable_x64", x64)
        try:
            tag = "x64_on" if x64 else "x64_off"
            log = canary_jax.ViolationLog.allocate(ring_capacity=1024)
            t, log, info = harness.time_jax(step_pallas, log, (buf, plan, tensors), n=args.n_verify, reps=args.reps)
            rec[f"pallas_{tag}"] = {"us_per_call": t * 1e6, **info, "write_index": int(log.write_index[0])}
            if not args.skip_reference and (not x64 or args.ref_x64_on):
                rlog = canary_jax.ViolationLog.allocate(ring_capacity=1024)
                tr, rlog, rinfo = harness.time_jax(step_ref, rlog, (buf, plan, tensors), n=args.n_ref, reps=args.reps)
                rec[f"reference_{tag}"] = {"us_per_call": tr * 1e6, **rinfo}
                same = all(
                    np.array_equal(np.asarray(getattr(log, f)), np.asarray(getattr(rlog, f)))
                    for f in ("ring", "write_index")
                )
                rec[f"equal_to_reference_{tag}"] = bool(same)
        finally:
            jax.config.update("jax_enable_x64", False)
        _print_mode(case, tag, rec)
    if peer is not None:
        import cupy as cp

        cbuf = cp.from_dlpack(buf)
        csrc = [cp.from_dlpack(t) for t in tensors]
        srcargs = peer.sources([(a, 1, ROW_BYTES, ROW_BYTES) for a in csrc], int(case.mode))
        c_slots, c_pos, c_prev = (cp.asarray(plan_np[k]) for k in ("slots", "positions", "prev_slots"))
        c_tok = cp.full((e,), -1, cp.int64)
        nv, en = cp.asarray(np.array([e], np.int32)), cp.asarray(np.array([1], np.int32))
        ring = cp.zeros((1024, 8), cp.int64)
        wi = cp.zeros((1,), cp.int32)
        sc, kc = cp.zeros((1,), cp.uint64), cp.zeros((1,), cp.uint64)

        def launch(stream):
            peer.verify(
                cbuf,
                c_slots,
                c_tok,
                c_pos,
                c_prev,
                nv,
                en,
                ring,
                wi,
                sc,
                kc,
                tag=int(TAG),
                check=False,
                sources=srcargs,
                stream=stream,
            )

        tp, pinfo = harness.time_peer(launch, n=args.n_peer, reps=args.reps)
        cp.cuda.Device().synchronize()
        rec["peer"] = {"us_per_call": tp * 1e6, **pinfo, "write_index": int(wi.get()[0])}
        print(f"  {case.id}: peer {tp * 1e6:.1f} us (violations {int(wi.get()[0])})", flush=True)


# --- write -------------------------------------------------------------------------------------------------
def run_write(case: Case, data: Data, args, cfg, peer, results, x64_modes):
    reqs, length = case.reqs, case.length
    t = reqs * length
    w = harness.write_inputs(case, data, args, lambda buf, *a: harness.populate(data, buf, *a, cfg)[0])
    srcs, tensors, slots, buf0, seeds, positions = w.srcs, w.tensors, w.slots, w.buf0, w.seeds, w.positions
    plan, ids_np = w.plan, w.ids_np
    ids, pos, loc = harness.int64_pairs(ids_np), harness.int64_pairs(positions), harness.int64_pairs(slots)
    rec = _record(case, results)
    rec["needed_bytes"] = harness.needed_bytes(case, args)
    rec["entries"] = t

    def step_pallas(state, c):
        ctx = harness.make_context(state[0], state[1], harness.with_tensors(srcs, c[4]), case.mode)
        out = write_pallas(ctx, c[0], c[1], c[2], c[3], config=cfg)
        return out.canary_buf, out.log

    def step_ref(state, c):
        ctx = harness.make_context(state[0], state[1], harness.with_tensors(srcs, c[4]), case.mode)
        out = reference.write_reference(ctx, c[0], c[1], c[2], c[3])
        return out.canary_buf, out.log

    consts = (plan, ids, pos, loc, tensors)
    final = {}
    for x64 in x64_modes:
        jax.config.update("jax_enable_x64", x64)
        try:
            tag = "x64_on" if x64 else "x64_off"
            state = (jnp.copy(buf0), canary_jax.ViolationLog.allocate(ring_capacity=1024))
            # A decode write lasts tens of microseconds: 20x the launches keep the dispatch jitter (the empty
            # program's spread) under a microsecond per call.
            n = args.n_write if length > 1 else 20 * args.n_write
            tp, state, info = harness.time_jax(step_pallas, state, consts, n=n, reps=args.reps)
            rec[f"pallas_{tag}"] = {"us_per_call": tp * 1e6, **info, "write_index": int(state[1].write_index[0])}
            final["pallas"] = state
            if not args.skip_reference and (not x64 or args.ref_x64_on):
                slow = length > 1
                rstate = (jnp.copy(buf0), canary_jax.ViolationLog.allocate(ring_capacity=1024))
                tr, rstate, rinfo = harness.time_jax(
                    step_ref, rstate, consts, n=1 if slow else args.n_ref, reps=1 if slow else args.reps
                )
                rec[f"reference_{tag}"] = {"us_per_call": tr * 1e6, **rinfo}
                rec[f"equal_to_reference_{tag}"] = bool(
                    jnp.array_equal(state[0], rstate[0])
                    and np.array_equal(np.asarray(state[1].ring), np.asarray(rstate[1].ring))
                    and int(state[1].write_index[0]) == int(rstate[1].write_index[0])
                )
        finally:
            jax.config.update("jax_enable_x64", False)
        _print_mode(case, tag, rec)
    if peer is not None:
        import cupy as cp

        cbuf = cp.array(cp.from_dlpack(buf0), copy=True)
        csrc = [cp.from_dlpack(x) for x in tensors]
        srcargs = peer.sources([(a, 1, ROW_BYTES, ROW_BYTES) for a in csrc], int(case.mode))
        off = np.zeros((reqs + 1,), np.int64)
        off[1:] = np.cumsum([length] * reqs)
        c_off, c_seed = cp.asarray(off), cp.asarray(np.asarray(seeds, np.int64))
        c_ids, c_pos, c_loc = cp.asarray(ids_np.astype(np.int64)), cp.asarray(positions), cp.asarray(slots)
        nvr = cp.asarray(np.array([reqs], np.int32))
        flag = cp.ones((1,), cp.int32)
        ring = cp.zeros((1024, 8), cp.int64)
        wi = cp.zeros((1,), cp.int32)
        sc, kc = cp.zeros((1,), cp.uint64), cp.zeros((1,), cp.uint64)

        def launch(stream):
            peer.write(
                cbuf,
                c_off,
                c_seed,
                nvr,
                c_ids,
                c_pos,
                c_loc,
                ring,
                wi,
                sc,
                kc,
                flag,
                tag=int(TAG),
                sources=srcargs,
                stream=stream,
            )

        slow = length > 1
        tpeer, pinfo = harness.time_peer(launch, n=1 if slow else args.n_peer, reps=2 if slow else args.reps)
        cp.cuda.Device().synchronize()
        rec["peer"] = {"us_per_call": tpeer * 1e6, **pinfo, "write_index": int(wi.get()[0])}
        if "pallas" in final:
            ours = np.asarray(final["pallas"][0])
            rec["peer_buffer_equal"] = bool(np.array_equal(ours, cbuf.get()))
        print(f"  {case.id}: peer {tpeer * 1e6:.1f} us (equal buffers: {rec.get('peer_buffer_equal')})", flush=True)


def run_case(case: Case, data: Data, args, cfg, peer, results, x64_modes):
    """``run_verify`` or ``run_write``, by ``case.op``."""
    (run_verify if case.op == "verify" else run_write)(case, data, args, cfg, peer, results, x64_modes)


# --- probe: knob variants ----------------------------------------------------------------------------------
PROBE_VARIANTS = {
    "verify": [
        dict(),
        dict(verify_block=128),
        dict(verify_block=512),
        dict(verify_num_warps=8),
        dict(verify_num_warps=2),
        dict(gather="word", source_gather="word"),
        dict(source_gather="pair"),
        dict(gather="quad"),
        dict(multiplier="portable"),
        dict(verify_max_programs=1056),
    ],
    "write": [
        dict(),
        dict(write_prefetch=4),
        dict(write_prefetch=16),
        dict(multiplier="portable"),
        dict(write_block=64),
        dict(write_block=256),
        dict(write_lanes=16),
        dict(gather="word"),
    ],
}


PROBE_VARIANTS_MINI = {
    "verify": [dict(), dict(verify_block=128), dict(gather="word", source_gather="word"), dict(verify_num_warps=8)],
    "write": [dict(), dict(write_prefetch=16), dict(multiplier="portable")],
}


def run_probe(data: Data, args, results, *, mini: bool, variants=None, want=None, base_config=None):
    """Times knob variants (``variants``: op -> list of PallasConfig overrides on top of ``base_config``) of
    the cases ``want`` (ids), Pallas only, x64 off; ``results["probe:<case>:<overrides>"]``."""
    if want is None:
        want = (
            "verify_none",
            "verify_all_x4",
            f"write_1x{args.long_tokens}_none",
            f"write_{args.decode_reqs}x1_all_x4",
        )
        if mini:
            want = ("verify_all_x4", f"write_1x{args.long_tokens}_none")
    base = [c for c in cases(dataclasses.replace(args, only="")) if c.id in want]
    if variants is None:
        variants = PROBE_VARIANTS_MINI if mini else PROBE_VARIANTS
    for case in base:
        for kw in variants.get(case.op, ()):
            cfg = PallasConfig(**{**(base_config or {}), **kw})
            name = "probe:" + case.id + ":" + (",".join(f"{k}={v}" for k, v in kw.items()) or "default")
            sub = {}
            try:
                run_case(
                    dataclasses.replace(case, id=name),
                    data,
                    dataclasses.replace(args, ref_x64_on=False, skip_reference=True),
                    cfg,
                    None,
                    sub,
                    (False,),
                )
                results[name] = sub[name]
            except Exception as e:  # noqa: BLE001
                results[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
                print("  ", name, "FAILED", str(e)[:300], flush=True)
