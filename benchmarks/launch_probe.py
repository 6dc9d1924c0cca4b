"""A decode step's canary (plan + HEAD + TAIL, nothing else) with its batch fields narrow against widened, and the
serving step's Pallas decode attention against XLA's, in one run (issue #25).

* ``canary``: the serving benchmark's decode batch (``benchmarks.serving_step``: pool populated by the reference
  backend, layer 0's K array as the real-KV source) in a jitted loop of steps. ``narrow``: the step builds its
  ``CanaryBatch`` from the engine's int32 arrays, which reach the plan and phase kernels as they are; ``widened``:
  the step widens them to int64 pairs first (the launches every earlier tree made). Per step: device time of the
  loop minus an empty program (``benchmarks.harness.time_jax``) and, from one profiled call, the kernels and
  their launches.
* ``attention``: :func:`benchmarks.serving_step.decode_attention_pallas` and ``decode_attention_xla`` at the
  scenario's shapes (Qwen3-0.6B heads, 4096 tokens a request): the relative error and the time per call.

Usage (repository root): ``python3 -m benchmarks.launch_probe --json OUT.json [--scenario decode1,decode128]
[--mode partial] [--variants narrow,widened,NAME] [--variant-config NAME='{"phase_one_launch": false}'] [--small]``: a
variant NAME is the narrow step traced with those ``PallasConfig`` fields. Each part is written to the JSON as it
finishes (a run cut short keeps what it did).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks.serving_step import batch as sb
from benchmarks.serving_step.attention import decode_attention_xla
from benchmarks.serving_step.decode_kernel import decode_attention_pallas
from benchmarks.serving_step.profiles import hlo_index, profile_call
from benchmarks.serving_step.programs import barrier
from benchmarks.serving_step.shapes import QWEN3_0_6B, SMALL_MODEL, scenarios
from canary_jax.contract import ints
from canary_jax.runtime.step import canary_head, canary_plan, canary_tail
from pallas_kernels import config as pallas_config

FIELDS = ("rpi", "prefix", "extend", "ids", "positions", "loc")
_FINAL: dict = {}  # (scenario, mode) -> the first variant's final state, on the host


def canary_loop_step(cfg, m, page_size: int, read_bytes: int, widened: bool):
    """``state -> state`` of one decode step's canary; ``consts = (batch dict, layer 0's K array)``."""

    def step(state, consts):
        consts, state = barrier(consts, state)  # nothing of the step is hoisted out of the timed loop
        b, k0 = consts
        if widened:  # the int64 pairs every earlier tree's step built (one widening kernel a field on a GPU)
            b = {**b, **{n: ints.widen(b[n]) for n in FIELDS}}
        cb = sb.canary_batch(b, b["ids"])
        with jax.named_scope("canary_plan"):  # the serving step's scopes: the profile tells the loop's own kernels
            plans = canary_plan(state, cb, config=cfg)
        with jax.named_scope("canary_head"):
            state, plans = canary_head(state, cb, config=cfg, plans=plans)
        srcs = sb.sources_of(((k0,), ()), m, page_size, read_bytes)
        with jax.named_scope("canary_tail"):
            state, _ = canary_tail(state, plans, cb, config=cfg, real_kv_sources=srcs)
        return state

    return step


def run_canary(name: str, mode: str, variant: str, args, out: dict) -> None:
    fields = dict(json.loads(args.variant_config[variant])) if variant in args.variant_config else {}
    saved = pallas_config.DEFAULT_CONFIG
    pallas_config.DEFAULT_CONFIG = dataclasses.replace(saved, **fields)  # read when the step is traced
    jax.clear_caches()  # the step's inner jits cache their traces, made under another config
    try:
        _run_canary(name, mode, variant, args, out)
    finally:
        pallas_config.DEFAULT_CONFIG = saved
        jax.clear_caches()


def _run_canary(name: str, mode: str, variant: str, args, out: dict) -> None:
    m = SMALL_MODEL if args.small else QWEN3_0_6B
    scn = scenarios(args.small)[name]
    ps, rb = args.page_size, 2 * m.kv_dim
    sh = sb.shared_shapes({name: scn}, ps)
    b, pop = sb.make_batch(scn, m, sh, ps, args.seed)
    k0 = jax.random.normal(jax.random.PRNGKey(args.seed), (sh.num_pages, ps * m.kv_dim), jnp.bfloat16)
    state = sb.populate(sb.new_state(sh.num_pages * ps), mode, pop, ((k0,), ()), m, ps, rb, sh)
    cfg = sb.canary_config(scn, mode, "pallas")
    step = canary_loop_step(cfg, m, ps, rb, variant == "widened")  # any other variant: narrow
    n = scn.steps

    @functools.partial(jax.jit, donate_argnums=0)
    def many(s, c):
        return jax.lax.fori_loop(0, n, lambda i, s_: step(s_, c), s)

    t = time.perf_counter()
    prog = many.lower(state, (b, k0)).compile()
    compile_s = time.perf_counter() - t
    per_call, state, _ = harness.time_loop(prog, state, (b, k0), n=n, reps=args.reps)
    module, index = hlo_index(prog.as_text())
    holder = [state]

    def once():
        holder[0] = prog(holder[0], (b, k0))
        return holder[0]

    with tempfile.TemporaryDirectory() as logdir:
        _, prof = profile_call(once, logdir, module, index, n)
    final = [np.asarray(x) for x in jax.tree.leaves(holder[0])]  # both variants ran the same steps on one batch
    first = _FINAL.setdefault((name, mode), final)
    out[f"canary_{name}_{mode}_{variant}"] = {
        "same_state_as_first_variant": first is final or all(np.array_equal(a, b) for a, b in zip(first, final)),
        "us_per_step": 1e6 * per_call,
        "compile_s": compile_s,
        "kernel_sum_us": 1e3 * prof.get("kernel_sum_ms", float("nan")),
        "launches_per_step": sum(prof.get("launches_per_step", {}).values()),
        **_canary_and_loop(prof),
        "kernels": [
            {"kernel": k["kernel"], "part": k["part"], "us": 1e3 * k["ms_per_step"], "launches": k["launches_per_step"]}
            for k in prof.get("canary_kernels", [])[:40]
        ],
    }


def _canary_and_loop(prof: dict) -> dict:
    """The kernel time and launches per step of the canary apart from the timing loop's own kernels: the loop's
    are those whose HLO op_name lies outside the step's named scopes (parts ``other`` and ``memcpy``: the loop
    counter, the carry); the canary's are every other part (plan, HEAD, TAIL, and any unnamed kernel that ran
    among them, charged to the canary)."""
    ms, n = prof.get("parts_ms", {}), prof.get("launches_per_step", {})
    loop = [p for p in ms if p in ("other", "memcpy", "model")]
    canary = [p for p in ms if p not in loop]
    return {
        "canary_kernel_us": 1e3 * sum(ms[p] for p in canary),
        "canary_launches_per_step": sum(n.get(p, 0.0) for p in canary),
        "loop_kernel_us": 1e3 * sum(ms[p] for p in loop),
        "loop_parts": {p: {"us": 1e3 * ms[p], "launches": n.get(p, 0.0)} for p in loop},
    }


def run_attention(name: str, args, out: dict) -> None:
    m = SMALL_MODEL if args.small else QWEN3_0_6B
    scn = scenarios(args.small)[name]
    ps, b, ctx = args.page_size, scn.batch, scn.context
    pps = -(-ctx // ps)
    rng = np.random.default_rng(args.seed)
    key = jax.random.PRNGKey(args.seed + 1)
    shape = (b * pps + 1, ps, m.kv_heads, m.head_dim)
    kp = jax.random.normal(key, shape, jnp.bfloat16)
    vp = jax.random.normal(jax.random.fold_in(key, 1), shape, jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((b, m.q_heads, m.head_dim)) / np.sqrt(m.head_dim), jnp.bfloat16)
    bt = jnp.asarray(1 + rng.permutation(b * pps).reshape(b, pps), jnp.int32)
    lengths = jnp.full((b,), ctx, jnp.int32)
    res = {}
    outs = {}
    for impl, fn in (("pallas", decode_attention_pallas), ("xla", decode_attention_xla)):

        def step(q_, c, fn=fn):  # the output feeds the next call's query: nothing hoisted, same shapes
            return fn(q_, *c).astype(q_.dtype)

        outs[impl] = np.asarray(jax.jit(fn)(q, kp, vp, bt, lengths), np.float32)
        q0 = jnp.array(q, copy=True)  # time_jax donates its state
        per_call, _, info = harness.time_jax(step, q0, (kp, vp, bt, lengths), n=20, reps=args.reps)
        res[impl] = {"us_per_call": 1e6 * per_call, "compile_s": info["compile_s"]}
    res["rel_err"] = float(np.linalg.norm(outs["pallas"] - outs["xla"]) / np.linalg.norm(outs["xla"]))
    res["kv_bytes"] = int(2 * b * ctx * m.kv_dim * 2)
    res["pallas_gb_per_s"] = res["kv_bytes"] / res["pallas"]["us_per_call"] / 1e3
    out[f"attention_{name}"] = res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--scenario", default="decode1,decode128")
    ap.add_argument("--mode", default="partial", help="real-KV modes, comma-separated (none, partial, all)")
    ap.add_argument("--parts", default="canary,attention")
    ap.add_argument("--variants", default="narrow,widened", help="narrow, widened and names given --variant-config")
    ap.add_argument(
        "--variant-config",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="a narrow variant NAME whose launches take these PallasConfig fields (repeatable)",
    )
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="the CPU smoke shapes (interpreted kernels)")
    args = ap.parse_args(argv)
    args.variant_config = dict(v.split("=", 1) for v in args.variant_config)
    out: dict = {"environment": harness.environment(), "argv": argv, "errors": {}}
    t0 = time.perf_counter()

    def save():
        out["elapsed_s"] = time.perf_counter() - t0
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1, default=str)
        os.replace(tmp, args.json)

    jobs = []
    for name in args.scenario.split(","):
        if "canary" in args.parts:
            jobs += [
                (f"canary_{name}_{mode}_{v}", functools.partial(run_canary, name, mode, v))
                for mode in args.mode.split(",")
                for v in args.variants.split(",")
            ]
        if "attention" in args.parts:
            jobs.append((f"attention_{name}", functools.partial(run_attention, name)))
    for label, job in jobs:
        t = time.perf_counter()
        try:
            job(args, out)
        except Exception as e:  # noqa: BLE001 - a part that fails is recorded, the others still run
            out["errors"][label] = f"{type(e).__name__}: {str(e)[:500]}"
        print(f"[{time.perf_counter() - t0:7.1f}s] {label}: {time.perf_counter() - t:.1f}s", flush=True)
        save()
    print(json.dumps({k: v for k, v in out.items() if k != "environment"}, indent=1, default=str)[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
