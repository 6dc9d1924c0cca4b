#!/usr/bin/env python3
"""Times the Pallas verify / write kernels, the jnp references under jit and a CUDA peer, in one process.

Cases (each a frozen dataclass with an id):

* verify: ``--entries`` (default 1M) entries over a ``--pool`` (default 4M) slot pool, random slots in
  request-major chains (1024 tokens per request), sources of 256-byte rows; modes NONE, PARTIAL (1 and 4
  sources), ALL (1 and 4 sources). The canary is populated first so every entry is clean.
* write: one request of 32768 tokens and 4096 requests of 1 token (decode, seeded from already written
  slots); modes NONE, PARTIAL x4, ALL x1, ALL x4.

Every case runs with ``jax_enable_x64`` off, then on (Pallas; the references only with x64 off unless
``--ref-x64-on``). Timing: a jitted ``lax.fori_loop`` of ``n`` back-to-back launches that donates its state
(so the canary buffer / log are updated in place, as in serving), median over repetitions of
``(wall time of the program - wall time of an empty program with the same arguments) / n`` after
``block_until_ready``; the CUDA peer is timed with CUDA events around ``n`` launches captured in a CUDA graph
(plain launches if capture is unavailable). Results (us per call, ns per entry, GB/s of needed bytes and the
fraction of the H200's 4.8 TB/s, ratio to the peer, pass/fail of the targets) are printed as a table last and
written to ``$OUT`` (or ``--out``) as JSON and markdown. Correctness is checked along the way: Pallas
vs reference (and vs the peer) state after the same launches, byte for byte.

Usage (GPU): ``python3 benchmarks/bench.py [--quick] [--probe {none,mini,full}] [--only IDS] [--out DIR]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import dataclasses
import datetime
import functools
import json
import platform
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import canary_jax
from canary_jax import constants
from canary_jax import ints
from canary_jax import reference
from pallas_kernels.config import PallasConfig
from pallas_kernels.verify import verify_pallas
from pallas_kernels.write import write_pallas

HBM_BYTES_PER_S = 4.8e12
TAG = constants.CanaryLaunchTag.TAIL_K_FULL
NONE, PARTIAL, ALL = constants.RealKvHashMode.NONE, constants.RealKvHashMode.PARTIAL, constants.RealKvHashMode.ALL
ROW_BYTES = 256
SGLANG_PEER_US = {  # the reference numbers for a CUDA implementation of SGLang's design on our H200
    "verify_none": 96, "verify_partial_x1": 142, "verify_all_x1": 338, "verify_all_x4": 1208,
    "write_1x32768_none": 7700, "write_1x32768_all_x4": 350_000,
    "write_4096x1_none": 18, "write_4096x1_all_x4": 29,
}


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    op: str  # verify | write
    mode: constants.RealKvHashMode
    num_sources: int
    reqs: int = 0
    length: int = 0


def _print_mode(case, tag: str, rec: dict) -> None:
    """One progress line per case and x64 mode: the Pallas time and, when measured, the reference's."""
    ref = rec.get(f"reference_{tag}")
    print(f"  {case.id} {tag}: pallas {rec[f'pallas_{tag}']['us_per_call']:.1f} us"
          + (f", reference {ref['us_per_call']:.1f} us" if ref is not None else ""), flush=True)


def cases(args) -> list[Case]:
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
    first = ("verify_none", "verify_all_x4", f"write_{args.decode_reqs}x1_all_x4", f"write_1x{args.long_tokens}_none",
             f"write_1x{args.long_tokens}_all_x4")  # the targeted cases first, in case the run is cut short
    return sorted(out, key=lambda c: (first.index(c.id) if c.id in first else len(first)))


# --- timing ------------------------------------------------------------------------------------------------
def _median(xs):
    return float(np.median(np.asarray(xs)))


def time_jax(step, state, consts, *, n: int, reps: int):
    """Per-call seconds of ``state = step(state, consts)``.

    A jitted ``lax.fori_loop`` of ``n`` launches (static trip count: XLA runs it without host round trips,
    and the kernels are compiled once) that donates its state, minus an empty jitted program with the same
    arguments (the dispatch overhead), divided by ``n``; median over ``reps``. The loop's counter update is
    counted as ours (a bias of about a microsecond per call, against us).
    """
    @functools.partial(jax.jit, donate_argnums=0)
    def many(s, c):
        return jax.lax.fori_loop(0, n, lambda i, s_: step(s_, c), s)

    @functools.partial(jax.jit, donate_argnums=0)
    def empty(s, c):  # same arguments, no device work: its wall time is the dispatch overhead
        return s

    t0 = time.perf_counter()
    state = jax.block_until_ready(many(state, consts))  # compile + warm up
    compile_s = time.perf_counter() - t0
    state = jax.block_until_ready(empty(state, consts))
    state = jax.block_until_ready(many(state, consts))
    walls, base = [], []
    for _ in range(reps):
        t = time.perf_counter()
        state = jax.block_until_ready(empty(state, consts))
        base.append(time.perf_counter() - t)
        t = time.perf_counter()
        state = jax.block_until_ready(many(state, consts))
        walls.append(time.perf_counter() - t)
    per_call = max(_median(walls) - _median(base), 0.0) / n
    return per_call, state, {"compile_s": compile_s, "wall_s": walls, "empty_s": base, "n": n}


def time_peer(launch, *, n: int, reps: int):
    import cupy as cp

    stream = cp.cuda.Stream(non_blocking=True)
    graph = None
    try:
        with stream:
            stream.begin_capture()
            for _ in range(n):
                launch(stream)
            graph = stream.end_capture()
        graph.upload(stream)
    except Exception:  # noqa: BLE001 - fall back to plain launches
        graph = None
    run = (lambda: graph.launch(stream)) if graph is not None else (lambda: [launch(stream) for _ in range(n)])
    run()
    stream.synchronize()
    ts = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record(stream)
        run()
        b.record(stream)
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) * 1e-3)
    return _median(ts) / n, {"graph": graph is not None, "n": n, "event_s": ts}


# --- data --------------------------------------------------------------------------------------------------
class Data:
    def __init__(self, args):
        self.args = args
        self.rng = np.random.default_rng(args.seed)
        n = args.pool
        key = jax.random.PRNGKey(args.seed)
        self.sources_u8 = []
        for k in range(4):
            bits = jax.random.bits(jax.random.fold_in(key, k), (n, ROW_BYTES // 4), jnp.uint32)
            self.sources_u8.append(jax.lax.bitcast_convert_type(bits, jnp.uint8).reshape(n, ROW_BYTES))
        jax.block_until_ready(self.sources_u8)
        self.perm = self.rng.permutation(np.arange(1, n, dtype=np.int64))

    def sources(self, k: int):
        return tuple(canary_jax.RealKvSource(tensor=t, page_size=1, num_bytes_per_token=ROW_BYTES, read_bytes=ROW_BYTES)
                     for t in self.sources_u8[:k])


def _pairs(a) -> jax.Array:
    return jnp.asarray(ints.int64_to_pairs_np(np.asarray(a, np.int64)))


def _ctx(buf, log, srcs, mode):
    return canary_jax.VerifyOrWriteContext(canary_buf=buf, kernel_kind=TAG, log=log, real_kv_sources=srcs,
                                   real_kv_hash_mode=mode)


def _with_tensors(srcs, tensors):
    return tuple(canary_jax.RealKvSource(tensor=t, page_size=s.page_size, num_bytes_per_token=s.num_bytes_per_token,
                                 read_bytes=s.read_bytes) for s, t in zip(srcs, tensors))


def needed_bytes(case: Case, args) -> float:
    eff = 0 if case.mode == NONE else (16 if case.mode == PARTIAL else ROW_BYTES)
    if case.op == "verify":
        # plan slot/pos/prev 24 B + slot record 32 B + predecessor record 24 B + source bytes
        return args.entries * (24 + 32 + 24 + case.num_sources * eff)
    t = case.reqs * case.length
    # per token: slot/token/position 24 B + record store 32 B + source bytes; per request: offsets 16 B,
    # seed 8 B + seed record 24 B
    return t * (24 + 32 + case.num_sources * eff) + case.reqs * (16 + 8 + 24)


# --- verify ------------------------------------------------------------------------------------------------
def populate(data: Data, buf, srcs, mode, slots2d, positions2d, cfg):
    """Writes clean chains (request-major) into ``buf`` with the Pallas write; returns the new buffer."""
    reqs, length = slots2d.shape
    plan = canary_jax.WritePlan.from_requests(counts=[length] * reqs, seed_slots=[-1] * reqs)
    ids = data.rng.integers(0, 1 << 31, reqs * length)
    ctx = _ctx(buf, canary_jax.ViolationLog.allocate(ring_capacity=64), srcs, mode)
    del cfg  # always the default config: one compile serves every case and probe variant
    out = write_pallas(ctx, plan, _pairs(ids), _pairs(positions2d.reshape(-1)), _pairs(slots2d.reshape(-1)))
    assert int(out.log.write_index[0]) == 0
    return out.canary_buf, ids


def run_verify(case: Case, data: Data, args, cfg, peer, results, x64_modes):
    e, length = args.entries, 1024
    reqs = e // length
    slots2d = data.perm[: reqs * length].reshape(reqs, length)
    pos2d = np.broadcast_to(np.arange(length, dtype=np.int64), (reqs, length))
    prev2d = np.concatenate([np.full((reqs, 1), -1, np.int64), slots2d[:, :-1]], axis=1)
    srcs = data.sources(case.num_sources)
    buf = jnp.zeros((args.pool, 32), jnp.uint8)
    buf, _ = populate(data, buf, srcs, case.mode, slots2d, pos2d, cfg)
    plan_np = dict(slots=slots2d.reshape(-1), positions=pos2d.reshape(-1), prev_slots=prev2d.reshape(-1))
    plan = canary_jax.VerifyPlan.from_entries(**plan_np)
    tensors = tuple(s.tensor for s in srcs)
    rec = results.setdefault(case.id, {"case": dataclasses.asdict(case) | {"mode": case.mode.name}})
    rec["needed_bytes"] = needed_bytes(case, args)
    rec["entries"] = e

    def step_pallas(log, c):
        return verify_pallas(_ctx(c[0], log, _with_tensors(srcs, c[2]), case.mode), c[1], config=cfg).log

    def step_ref(log, c):
        return reference.verify_reference(_ctx(c[0], log, _with_tensors(srcs, c[2]), case.mode), c[1]).log

    for x64 in x64_modes:
        jax.config.update("jax_enable_x64", x64)
        try:
            tag = "x64_on" if x64 else "x64_off"
            log = canary_jax.ViolationLog.allocate(ring_capacity=1024)
            t, log, info = time_jax(step_pallas, log, (buf, plan, tensors), n=args.n_verify, reps=args.reps)
            rec[f"pallas_{tag}"] = {"us_per_call": t * 1e6, **info, "write_index": int(log.write_index[0])}
            if not args.skip_reference and (not x64 or args.ref_x64_on):
                rlog = canary_jax.ViolationLog.allocate(ring_capacity=1024)
                tr, rlog, rinfo = time_jax(step_ref, rlog, (buf, plan, tensors), n=args.n_ref, reps=args.reps)
                rec[f"reference_{tag}"] = {"us_per_call": tr * 1e6, **rinfo}
                same = all(np.array_equal(np.asarray(getattr(log, f)), np.asarray(getattr(rlog, f)))
                           for f in ("ring", "write_index"))
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
            peer.verify(cbuf, c_slots, c_tok, c_pos, c_prev, nv, en, ring, wi, sc, kc, tag=int(TAG), check=False,
                        sources=srcargs, stream=stream)

        tp, pinfo = time_peer(launch, n=args.n_peer, reps=args.reps)
        cp.cuda.Device().synchronize()
        rec["peer"] = {"us_per_call": tp * 1e6, **pinfo, "write_index": int(wi.get()[0])}
        print(f"  {case.id}: peer {tp * 1e6:.1f} us (violations {int(wi.get()[0])})", flush=True)


# --- write -------------------------------------------------------------------------------------------------
def run_write(case: Case, data: Data, args, cfg, peer, results, x64_modes):
    reqs, length = case.reqs, case.length
    t = reqs * length
    srcs = data.sources(case.num_sources)
    tensors = tuple(s.tensor for s in srcs)
    slots = data.perm[-t:]  # distinct from each other
    buf0 = jnp.zeros((args.pool, 32), jnp.uint8)
    if length == 1:  # decode: seeds are slots written one step earlier (positions 0 .. reqs-1 + 10)
        seeds = data.perm[-t - reqs: -t]
        seed_pos = np.arange(reqs, dtype=np.int64) + 10
        buf0, _ = populate(data, buf0, srcs, case.mode, seeds.reshape(reqs, 1), seed_pos.reshape(reqs, 1), cfg)
        positions = seed_pos + 1
    else:
        seeds = np.full((reqs,), -1, np.int64)
        positions = np.arange(t, dtype=np.int64)
    plan = canary_jax.WritePlan.from_requests(counts=[length] * reqs, seed_slots=seeds)
    ids_np = data.rng.integers(0, 1 << 31, t)
    ids, pos, loc = _pairs(ids_np), _pairs(positions), _pairs(slots)
    rec = results.setdefault(case.id, {"case": dataclasses.asdict(case) | {"mode": case.mode.name}})
    rec["needed_bytes"] = needed_bytes(case, args)
    rec["entries"] = t

    def step_pallas(state, c):
        out = write_pallas(_ctx(state[0], state[1], _with_tensors(srcs, c[4]), case.mode), c[0], c[1], c[2], c[3],
                           config=cfg)
        return out.canary_buf, out.log

    def step_ref(state, c):
        out = reference.write_reference(_ctx(state[0], state[1], _with_tensors(srcs, c[4]), case.mode), c[0], c[1], c[2],
                                c[3])
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
            tp, state, info = time_jax(step_pallas, state, consts, n=n, reps=args.reps)
            rec[f"pallas_{tag}"] = {"us_per_call": tp * 1e6, **info, "write_index": int(state[1].write_index[0])}
            final["pallas"] = state
            if not args.skip_reference and (not x64 or args.ref_x64_on):
                slow = length > 1
                rstate = (jnp.copy(buf0), canary_jax.ViolationLog.allocate(ring_capacity=1024))
                tr, rstate, rinfo = time_jax(step_ref, rstate, consts, n=1 if slow else args.n_ref,
                                             reps=1 if slow else args.reps)
                rec[f"reference_{tag}"] = {"us_per_call": tr * 1e6, **rinfo}
                rec[f"equal_to_reference_{tag}"] = bool(
                    jnp.array_equal(state[0], rstate[0])
                    and np.array_equal(np.asarray(state[1].ring), np.asarray(rstate[1].ring))
                    and int(state[1].write_index[0]) == int(rstate[1].write_index[0]))
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
            peer.write(cbuf, c_off, c_seed, nvr, c_ids, c_pos, c_loc, ring, wi, sc, kc, flag, tag=int(TAG),
                       sources=srcargs, stream=stream)

        slow = length > 1
        tpeer, pinfo = time_peer(launch, n=1 if slow else args.n_peer, reps=2 if slow else args.reps)
        cp.cuda.Device().synchronize()
        rec["peer"] = {"us_per_call": tpeer * 1e6, **pinfo, "write_index": int(wi.get()[0])}
        if "pallas" in final:
            ours = np.asarray(final["pallas"][0])
            rec["peer_buffer_equal"] = bool(np.array_equal(ours, cbuf.get()))
        print(f"  {case.id}: peer {tpeer * 1e6:.1f} us (equal buffers: {rec.get('peer_buffer_equal')})", flush=True)


# --- probe: knob variants ----------------------------------------------------------------------------------
PROBE_VARIANTS = {
    "verify": [
        dict(), dict(verify_block=128), dict(verify_block=512), dict(verify_num_warps=8),
        dict(verify_num_warps=2), dict(gather="word", source_gather="word"), dict(source_gather="pair"),
        dict(gather="quad"), dict(multiplier="portable"), dict(verify_max_programs=1056),
    ],
    "write": [
        dict(), dict(write_prefetch=4), dict(write_prefetch=16), dict(multiplier="portable"),
        dict(write_block=64), dict(write_block=256), dict(write_lanes=16), dict(gather="word"),
    ],
}


PROBE_VARIANTS_MINI = {
    "verify": [dict(), dict(verify_block=128), dict(gather="word", source_gather="word"), dict(verify_num_warps=8)],
    "write": [dict(), dict(write_prefetch=16), dict(multiplier="portable")],
}


def run_probe(data: Data, args, results, *, mini: bool, variants=None, want=None, base_config=None):
    """Times knob variants (``variants``: op -> list of PallasConfig overrides on top of ``base_config``) of
    the cases ``want`` (ids), Pallas only, x64 off."""
    if want is None:
        want = ("verify_none", "verify_all_x4", f"write_1x{args.long_tokens}_none",
                f"write_{args.decode_reqs}x1_all_x4")
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
                (run_verify if case.op == "verify" else run_write)(
                    dataclasses.replace(case, id=name), data, dataclasses.replace(args, ref_x64_on=False,
                                                                                 skip_reference=True), cfg,
                    None, sub, (False,))
                results[name] = sub[name]
            except Exception as e:  # noqa: BLE001
                results[name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
                print("  ", name, "FAILED", str(e)[:300], flush=True)


# --- report ------------------------------------------------------------------------------------------------
def summarize(results, args) -> tuple[list[dict], str]:
    rows = []
    for cid, rec in results.items():
        if not isinstance(rec, dict) or "case" not in rec or cid.startswith("probe:"):
            continue
        row = {"id": cid}
        peer_us = rec.get("peer", {}).get("us_per_call")
        for impl in ("pallas_x64_off", "pallas_x64_on", "reference_x64_off"):
            if impl in rec:
                us = rec[impl]["us_per_call"]
                row[impl + "_us"] = us
                if impl.startswith("pallas"):
                    row[impl + "_ns_per_entry"] = 1e3 * us / rec["entries"]
                    row[impl + "_gb_s"] = rec["needed_bytes"] / (us * 1e-6) / 1e9 if us > 0 else float("inf")
                    row[impl + "_hbm_frac"] = row[impl + "_gb_s"] * 1e9 / HBM_BYTES_PER_S
        row["peer_us"] = peer_us
        p = row.get("pallas_x64_off_us")
        if peer_us and p:
            row["speedup_vs_peer"] = peer_us / p
        if p and row.get("pallas_x64_on_us"):
            row["x64_off_over_on"] = p / row["pallas_x64_on_us"]
        row["equal_to_reference"] = rec.get("equal_to_reference_x64_off")
        row["peer_buffer_equal"] = rec.get("peer_buffer_equal")
        row["targets"] = targets(cid, row)
        rows.append(row)
    lines = ["| case | pallas us (x64 off) | x64 on us | off/on | ns/entry | GB/s needed | % of 4.8 TB/s | "
             "reference us | peer us | peer / pallas | equal ref | targets |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    for r in rows:
        lines.append("| " + " | ".join([
            r["id"], f(r.get("pallas_x64_off_us")), f(r.get("pallas_x64_on_us")), f(r.get("x64_off_over_on"), "{:.2f}"),
            f(r.get("pallas_x64_off_ns_per_entry"), "{:.2f}"), f(r.get("pallas_x64_off_gb_s"), "{:.0f}"),
            f(100 * r["pallas_x64_off_hbm_frac"] if r.get("pallas_x64_off_hbm_frac") is not None else None, "{:.1f}"),
            f(r.get("reference_x64_off_us")), f(r.get("peer_us")), f(r.get("speedup_vs_peer"), "{:.2f}x"),
            str(r.get("equal_to_reference")), r["targets"] or "-"]) + " |")
    return rows, "\n".join(lines)


def targets(cid: str, row: dict) -> str:
    out = []
    p, s = row.get("pallas_x64_off_us"), row.get("speedup_vs_peer")
    if cid in ("verify_none", "verify_partial_x1", "verify_partial_x4") and s is not None:
        out.append(f"peer ratio >= 1.0x: {'PASS' if s >= 1.0 else 'MISS'}")
    if cid == "verify_all_x4":
        if s is not None:
            out.append(f">= 3x peer: {'PASS' if s >= 3 else 'MISS'}")
        if row.get("pallas_x64_off_hbm_frac") is not None:
            out.append(f">= 60% HBM: {'PASS' if row['pallas_x64_off_hbm_frac'] >= 0.6 else 'MISS'}")
    if cid.startswith("write_1x") and (cid.endswith("_none") or cid.endswith("_all_x4")) and p:
        out.append(f"<= 3 ms: {'PASS' if p <= 3000 else 'MISS'}")
    if cid.endswith("x1_all_x4") and p:
        out.append(f"<= 20 us: {'PASS' if p <= 20 else 'MISS'}")
    r = row.get("x64_off_over_on")
    if r is not None:
        out.append(f"off/on <= 1.2: {'PASS' if r <= 1.2 else 'MISS'}")
    return "; ".join(out)


def environment() -> dict:
    env = {"date": datetime.date.today().isoformat(), "python": platform.python_version(), "jax": jax.__version__,
           "devices": [str(d) for d in jax.devices()], "argv": sys.argv}
    for mod in ("jaxlib", "cupy", "torch", "triton", "numpy"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            pass
    try:
        env["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm",
                                            "--format=csv,noheader"], capture_output=True, text=True,
                                           timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    try:
        env["git"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                    cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except Exception:  # noqa: BLE001
        pass
    return env


@dataclasses.dataclass(frozen=True)
class Args:
    pool: int
    entries: int
    long_tokens: int
    decode_reqs: int
    reps: int
    n_verify: int
    n_write: int
    n_ref: int
    n_peer: int
    seed: int
    only: str
    ref_x64_on: bool
    skip_reference: bool


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="smaller repetition counts")
    ap.add_argument("--probe", choices=("none", "mini", "full"), default="none",
                    help="time knob variants of a few cases after the cases (mini) or instead of them (full)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--pool", type=int, default=1 << 22)
    ap.add_argument("--entries", type=int, default=1 << 20)
    ap.add_argument("--long-tokens", type=int, default=32768)
    ap.add_argument("--decode-reqs", type=int, default=4096)
    ap.add_argument("--only", default="", help="comma-separated substrings of case ids")
    ap.add_argument("--x64", choices=("off", "on", "both"), default="both")
    ap.add_argument("--ref-x64-on", action="store_true")
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default="{}", help="JSON PallasConfig overrides for every Pallas launch")
    ap.add_argument("--probe-json", default="", help='JSON {"verify": [overrides...], "write": [...]}: the probe '
                    "variants (default: the built-in lists)")
    ap.add_argument("--probe-cases", default="", help="comma-separated case ids the probe runs (default: built-in)")
    a = ap.parse_args()
    base_config = json.loads(a.config)
    probe_variants = json.loads(a.probe_json) if a.probe_json else None
    probe_cases = tuple(a.probe_cases.split(",")) if a.probe_cases else None
    args = Args(pool=a.pool, entries=a.entries, long_tokens=a.long_tokens, decode_reqs=a.decode_reqs, reps=3 if a.quick else 5,
                n_verify=20, n_write=10, n_ref=3, n_peer=20, seed=a.seed, only=a.only, ref_x64_on=a.ref_x64_on,
                skip_reference=a.skip_reference)
    os.makedirs(a.out, exist_ok=True)
    env = environment()
    print(json.dumps(env), flush=True)
    results: dict = {"environment": env, "args": dataclasses.asdict(args), "config": base_config,
                     "probe_variants": probe_variants}
    t_start = time.perf_counter()
    data = Data(args)
    peer = None
    if not a.no_peer and jax.default_backend() == "gpu":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from cuda_peer import CudaPeer

        try:
            peer = CudaPeer()
            peer._verify.attributes  # noqa: B018 - compile now, not inside the first case
        except Exception as e:  # noqa: BLE001
            results["peer_error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
    x64_modes = {"off": (False,), "on": (True,), "both": (False, True)}[a.x64]

    def dump():
        with open(os.path.join(a.out, "bench.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)

    if a.probe == "full":
        run_probe(data, args, results, mini=False, variants=probe_variants, want=probe_cases, base_config=base_config)
    else:
        cfg = PallasConfig(**base_config)
        for case in cases(args):
            print(f"[{time.perf_counter() - t_start:6.1f}s] {case.id}", flush=True)
            try:
                (run_verify if case.op == "verify" else run_write)(case, data, args, cfg, peer, results, x64_modes)
            except Exception as e:  # noqa: BLE001
                results.setdefault(case.id, {})["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            dump()
    if a.probe == "mini":
        run_probe(data, args, results, mini=True, variants=probe_variants, want=probe_cases, base_config=base_config)
    rows, table = summarize(results, args)
    results["summary"] = rows
    dump()
    probe_lines = []
    for k, v in results.items():
        if k.startswith("probe:"):
            us = v.get("pallas_x64_off", {}).get("us_per_call") if isinstance(v, dict) else None
            probe_lines.append(f"{k}: {us if us is None else round(us, 1)} us {v.get('error', '')}")
    md = [f"# canary-jax benchmark ({env['date']})", "", "```", json.dumps(env, indent=1), "```", "", table]
    if probe_lines:
        md += ["", "## knob probe", "", *probe_lines]
    with open(os.path.join(a.out, "bench.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"total {time.perf_counter() - t_start:.1f}s")
    print("\n".join(probe_lines))
    print(table)


if __name__ == "__main__":
    main()
