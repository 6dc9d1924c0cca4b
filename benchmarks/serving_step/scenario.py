"""One scenario end to end: lower and compile every program, populate the canary states, warm up, time the
modes in interleaved rounds, profile, check a clean run and the fault, and time the parts as their own programs."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import canary_jax as cj
from benchmarks.serving_step.attention import Attention, attention_label
from benchmarks.serving_step.batch import Shared, make_batch, new_state, populate
from benchmarks.serving_step.carry import Carry, fault_check
from benchmarks.serving_step.profiles import hlo_index, profile_call, profile_launches, sanitize
from benchmarks.serving_step.programs import EMPTY, build_program, loop_of, part_args, part_programs, plan_of
from benchmarks.serving_step.report import canary_split
from benchmarks.serving_step.shapes import bucket, roofline
from benchmarks.serving_step.timing import _compile_one, compile_all, log, wall


def run_scenario(scn, m, params, kv, attn, args, t0, sh: Shared, res: dict, checkpoint) -> tuple[dict, tuple]:
    """Fills ``res`` (calling ``checkpoint()`` after each stage, so a run cut by a timeout keeps what it
    measured); returns ``(res, kv)``."""
    num_pages = sh.num_pages
    res.update(config=dataclasses.asdict(scn), roofline=roofline(scn, m))
    modes = args.modes
    ps = args.page_size
    rb = args.read_bytes or 2 * m.kv_dim
    res["config"].update(
        page_size=ps,
        pool_pages=num_pages,
        pool_slots=num_pages * ps,
        verify_capacity=bucket(scn.verify_entries),
        sweep_capacity=bucket(scn.sweep_entries),
        sweep_interval=args.sweep_interval,
        read_bytes_all=rb,
        attention=attention_label(attn, scn.kind),
        canary_backend=cj.resolve_backend(args.backend),
    )
    b, pop = make_batch(scn, m, sh, ps, args.seed)
    canary_modes = [x for x in modes if x != "off"]
    cs = Carry(
        kv,
        {x: new_state(num_pages * ps) for x in canary_modes},
        {x: jnp.asarray(pop["toks"]) for x in modes},
        {x: (jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32)) for x in modes},
    )
    consts = (params, b)
    do_parts = bool(canary_modes) and (args.parts == "all" or scn.name in args.parts.split(","))

    # 1. Lower every program (tracing needs only shapes) and compile each as soon as it is lowered, concurrently
    # (the steps first; the parts' programs, with no GEMMs and so no GPU autotuning, finish in the background);
    # populate the canary states meanwhile.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.workers))
    lowered, futs = {}, {}

    def submit(key, lo):
        lowered[key] = lo
        futs[key] = pool.submit(_compile_one, lo)

    try:
        for x in modes:
            submit(("step", x), build_program(scn, x, m, attn, args, args.sweep_interval).lower(cs.of(x), consts))
            submit(("empty", x), EMPTY.lower(cs.of(x), consts))
        parts = part_programs(scn, m, args, modes) if do_parts else {}
        if parts:
            head_mode = parts["plan"][1]
            plans0 = jax.eval_shape(plan_of(scn, m, head_mode, args), cs.states[head_mode], b, cs.toks[head_mode])
            for name, (fn, x) in parts.items():
                c, k = part_args(name, cs.states[x], plans0, b, cs.toks[x], cs.kv)
                c = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), c)
                submit(("part", name), loop_of(fn, scn.part_launches).lower(c, k))
                submit(("pempty", name), EMPTY.lower(c, k))
        log(f"{scn.name}: lowered {len(lowered)} programs; compiling ({args.workers} threads), populating", t0)
        tp = time.perf_counter()
        for x in canary_modes:
            cs.states[x] = populate(cs.states[x], x, pop, cs.kv, m, ps, rb, sh)
        jax.block_until_ready(cs.states)
        res["populate_s"] = time.perf_counter() - tp
        log(f"{scn.name}: populated {len(canary_modes)} states in {res['populate_s']:.1f}s", t0)
        compiled = {k: f.result() for k, f in futs.items() if k[0] in ("step", "empty")}
        return _run_compiled(
            scn, m, params, attn, args, t0, res, checkpoint, cs, consts, b, pop, lowered, parts, futs, compiled
        )
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _run_compiled(scn, m, params, attn, args, t0, res, checkpoint, cs, consts, b, pop, lowered, parts, futs, compiled):
    modes = args.modes
    ps = args.page_size
    canary_modes = [x for x in modes if x != "off"]
    failed = {k for k, v in compiled.items() if isinstance(v[0], Exception)}
    if any(k[0] == "step" for k in failed) and attn.decode == "pallas" and scn.kind == "decode":
        err = next(compiled[k][0] for k in failed if k[0] == "step")
        res["attention_fallback"] = f"step compile failed with Pallas attention: {str(err)[:400]}"
        attn = Attention(decode="xla", prefill=attn.prefill)
        res["config"]["attention"] = attention_label(attn, scn.kind)
        log(f"{scn.name}: recompiling with XLA attention", t0)
        redo = {
            ("step", x): build_program(scn, x, m, attn, args, args.sweep_interval).lower(cs.of(x), consts)
            for x in modes
        }
        compiled.update(compile_all(redo, args.workers))
        failed = {k for k, v in compiled.items() if isinstance(v[0], Exception)}
    res["compile_s"] = {f"{k[0]}:{k[1]}": round(v[1], 2) for k, v in compiled.items()}
    res["errors"] = {
        f"{k[0]}:{k[1]}": f"{type(v[0]).__name__}: {str(v[0])[:400]}" for k, v in compiled.items() if k in failed
    }
    log(f"{scn.name}: compiled (slowest {max(v[1] for v in compiled.values()):.1f}s, {len(failed)} failed)", t0)
    checkpoint()
    run = {x: compiled[("step", x)][0] for x in modes if ("step", x) not in failed}
    empty = {x: compiled[("empty", x)][0] for x in modes}

    # 2. Warm up, then interleaved rounds.
    mres = {x: {"call_s": [], "empty_s": []} for x in modes}
    for x in run:
        mres[x]["first_call_s"] = cs.call(run[x], x, consts)
    for r in range(args.rounds):
        for x in run:
            mres[x]["empty_s"].append(cs.call(empty[x], x, consts))
            mres[x]["call_s"].append(cs.call(run[x], x, consts))
        log(f"{scn.name}: round {r + 1}/{args.rounds}", t0)
    for x in run:
        mr = mres[x]
        per = [(c - e) / scn.steps for c, e in zip(mr["call_s"], mr["empty_s"])]
        mr["step_ms"] = 1e3 * float(np.median(per))
        mr["step_wall_ms"] = 1e3 * float(np.median(mr["call_s"])) / scn.steps
        mr["step_ms_rounds"] = [1e3 * p for p in per]
        mr["spread_pct"] = 100 * (max(per) - min(per)) / float(np.median(per))
    # 3. One profiled call per mode.
    if args.profile and time.perf_counter() - t0 < args.budget_s:
        for x in run:
            try:
                module, index = hlo_index(run[x].as_text())
                logdir = os.path.join(args.trace_dir, f"{scn.name}_{x}")
                _, mres[x]["profile"] = profile_call(
                    lambda x=x: cs.call(run[x], x, consts),
                    logdir,
                    module,
                    index,
                    scn.steps,
                    cycle=args.sweep_interval or scn.steps,
                )
            except Exception as e:  # noqa: BLE001
                mres[x]["profile_error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
        log(f"{scn.name}: profiled", t0)
        checkpoint()
    # 4. Clean run: no violations, plans enabled.
    for x in canary_modes:
        if x in run:
            mres[x]["violations_clean"] = int(cs.states[x].log.write_index[0])
            mres[x]["verify_enable"] = int(cs.summ[x][0][0])
            mres[x]["verify_num_valid"] = int(cs.summ[x][1][0])
    res["modes"] = mres
    off = mres.get("off", {}).get("step_ms")
    res["overhead_pct"] = {
        x: 100 * (mres[x]["step_ms"] / off - 1) for x in canary_modes if off and "step_ms" in mres[x]
    }
    # 5. A flipped byte in layer 0's K (a prefix slot, within its first 16 bytes) between steps.
    try:
        res["fault_check"] = fault_check(cs, run, consts, pop, ps, m)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        res["fault_check"] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    res["canary_split"] = canary_split(res)
    checkpoint()
    # 6. Parts as their own programs (copies of the states; same inputs).
    if parts and time.perf_counter() - t0 < args.budget_s:
        try:
            compiled.update({k: f.result() for k, f in futs.items() if k[0] in ("part", "pempty")})
            res["compile_s"].update({f"{k[0]}:{k[1]}": round(v[1], 2) for k, v in compiled.items()})
            res["parts_jit"] = run_parts(scn, parts, compiled, cs, b, m, args, t0)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            res["parts_jit"] = {"error": {"error": f"{type(e).__name__}: {str(e)[:400]}"}}
    return res, cs.kv


def run_parts(scn, parts, compiled, cs: Carry, b, m, args, t0) -> dict:
    out = {}
    head_mode = parts["plan"][1]
    plans = jax.jit(plan_of(scn, m, head_mode, args))(cs.states[head_mode], b, cs.toks[head_mode])
    for name, (_, x) in parts.items():
        prog, ctime = compiled[("part", name)]
        emp = compiled[("pempty", name)][0]
        if isinstance(prog, Exception):
            out[name] = {"error": f"{type(prog).__name__}: {str(prog)[:300]}", "compile_s": round(ctime, 2)}
            continue
        c, k = part_args(name, cs.states[x], plans, b, cs.toks[x], cs.kv)
        walls, bases = [], []
        c = jax.block_until_ready(prog(c, k))
        for _ in range(args.rounds):
            dt, c = wall(emp, c, k)
            bases.append(dt)
            dt, c = wall(prog, c, k)
            walls.append(dt)
        n = scn.part_launches
        rec = {
            "us": 1e6 * max(float(np.median(walls)) - float(np.median(bases)), 0.0) / n,
            "launches": n,
            "compile_s": round(ctime, 2),
        }
        if args.profile:
            try:
                logdir = os.path.join(args.trace_dir, f"{scn.name}_part_{sanitize(name)}")
                rec.update(profile_launches(prog, c, k, logdir, n))
            except Exception as e:  # noqa: BLE001
                rec["profile_error"] = f"{type(e).__name__}: {e}"
        out[name] = rec
    log(f"{scn.name}: parts timed ({len(out)})", t0)
    return out
