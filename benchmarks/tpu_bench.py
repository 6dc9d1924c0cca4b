#!/usr/bin/env python3
"""The TPU run: bench.py's verify / write cases and the serving step, backend ``pallas_tpu`` against ``reference``,
on whatever TPU is present. Refuses (exit 2, naming the platform found) where JAX sees no TPU.

Nothing here has run on a TPU yet: it is written to run unchanged on a TPU host (``docs/tpu_cost_model.md`` has
the expected figures it should be checked against).

* Kernel cases: ``benchmarks.kernel_cases.cases`` (the same ids and sizes as ``benchmarks.bench``: ``--entries``
  entries over a ``--pool``-slot pool, chains of 1024 tokens, 256-byte source rows; the writes 1 x
  ``--long-tokens`` and ``--decode-reqs`` x 1). Verify: ``pallas_kernels.tpu.verify.verify_tpu`` (compiled) and
  ``verify_reference``, their rings compared. Write: ``pallas_kernels.tpu.write.write_tpu`` (compiled) and
  ``write_reference``, their canary buffers and logs compared. The canary is populated with the reference write
  (bench.py uses the GPU Pallas write, interpreted off a GPU).
  Timing: ``benchmarks.harness.time_jax``, bench.py's method (a jitted, donating ``fori_loop`` of ``n`` launches
  minus an empty program, median over repetitions, after ``block_until_ready``).
* Serving step: ``python -m benchmarks.serving_step`` in process, once per backend (``pallas_tpu``,
  ``reference``), XLA attention (the step's attention kernels are GPU kernels), no profile, the KV pool sized for
  the chosen scenarios only (``--pool-for chosen``); a scenario whose KV pool does not fit in the device's memory
  (``memory_stats()["bytes_limit"]``, with 25 % headroom) is skipped and recorded as such (decode b128 and the
  prefill need about 60 GB of KV each).

Writes ``tpu_bench.json`` and ``tpu_bench.md`` (date, device kind, versions, the exact command, and a table) and
the serving step's ``serving_step_<backend>.json`` to ``--out`` (default ``$OUT`` or ``.``).

Usage (TPU host, repository root): ``python -m benchmarks.tpu_bench [--quick] [--only IDS] [--no-serving]
[--scenario decode1,decode128,prefill,write4096] [--out DIR]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import dataclasses
import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import canary_jax
from benchmarks import harness, kernel_cases
from canary_jax.ops import backends, reference

TPU_HBM_BYTES_PER_S = {"v5e": 819e9, "v5 lite": 819e9, "v6e": 1640e9, "v6 lite": 1640e9}
"""Published HBM bandwidths by device kind (substring, lower case): v5e 819 GB/s, v6e (Trillium) 1640 GB/s
(cloud.google.com/tpu/docs/v5e, /v6e)."""

INTERPRET = False
"""The TPU verify's ``interpret=`` here: compiled (a CPU smoke run of the case code sets it True)."""

SERVING_BACKENDS = ("pallas_tpu", "reference")
SERVING_SCENARIOS = ("decode1", "decode128", "prefill", "write4096")


class NoTpu(SystemExit):
    """Raised (exit status 2) where JAX's default backend is not a TPU."""


def require_tpu() -> list:
    """The TPU devices, or :class:`NoTpu` naming the platform found."""
    platform = jax.default_backend()
    if not backends.is_tpu_platform(platform):
        devs = ", ".join(str(d) for d in jax.devices())
        raise NoTpu(
            f"benchmarks.tpu_bench: no TPU here: JAX's default backend is {platform!r} (devices: {devs}). "
            "Run it on a TPU host (jax[tpu]); the GPU benchmark is `python -m benchmarks.bench`."
        )
    return jax.devices()


def hbm_bytes_per_s(device_kind: str) -> float | None:
    kind = device_kind.lower()
    return next((v for k, v in TPU_HBM_BYTES_PER_S.items() if k in kind), None)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tpu_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="smaller repetition counts")
    ap.add_argument("--pool", type=int, default=1 << 22)
    ap.add_argument("--entries", type=int, default=1 << 20)
    ap.add_argument("--long-tokens", type=int, default=32768)
    ap.add_argument("--decode-reqs", type=int, default=4096)
    ap.add_argument("--only", default="", help="comma-separated substrings of kernel case ids ('none' for none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-serving", action="store_true", help="skip the serving step")
    ap.add_argument("--scenario", default=",".join(SERVING_SCENARIOS), help="serving-step scenarios (comma list)")
    ap.add_argument("--serving-backends", default=",".join(SERVING_BACKENDS))
    return ap.parse_args(argv)


def bench_args(a) -> harness.Args:
    return harness.args_from_cli(a, n_peer=0)


def kernel_case_list(a) -> list[harness.Case]:
    """bench.py's cases (``--only`` filtered; ``--only none``: none)."""
    if a.only == "none":
        return []
    return kernel_cases.cases(bench_args(a))


def scenario_kv_bytes(name: str) -> int:
    """Bytes of the serving step's KV pool (all layers, K and V, bf16) sized for scenario ``name`` alone."""
    from benchmarks.serving_step.shapes import QWEN3_0_6B, scenarios

    if name == "write4096":
        return 0
    s = scenarios(False)[name]
    m = QWEN3_0_6B
    return s.cached_reqs * s.row_len * m.layers * 2 * m.kv_dim * 2


def serving_plan(a, bytes_limit: int | None) -> tuple[list[list[str]], dict]:
    """The serving-step command lines (one per backend) and the scenarios skipped for memory."""
    from benchmarks.serving_step.shapes import QWEN3_0_6B

    if a.no_serving:
        return [], {}
    want = [x.strip() for x in a.scenario.split(",") if x.strip()]
    skipped, run = {}, []
    for name in want:
        need = scenario_kv_bytes(name) + QWEN3_0_6B.weight_bytes
        if bytes_limit is not None and name != "write4096" and 1.25 * need > bytes_limit:
            skipped[name] = f"KV pool + weights {need / 1e9:.1f} GB (+25 %) > device limit {bytes_limit / 1e9:.1f} GB"
        else:
            run.append(name)
    if not run:
        return [], skipped
    cmds = []
    for be in [x.strip() for x in a.serving_backends.split(",") if x.strip()]:
        cmds.append(
            ["--scenario", ",".join(run), "--backend", be, "--attn-decode", "xla", "--attn-prefill", "xla",
             "--no-profile", "--pool-for", "chosen", "--json", os.path.join(a.out, f"serving_step_{be}.json")]
        )  # fmt: skip
    return cmds, skipped


# --- kernel cases ------------------------------------------------------------------------------------------
def run_verify(case, data, args, rec):
    from pallas_kernels.tpu.verify import verify_tpu

    slots2d, pos2d, prev2d = harness.verify_chains(data, args.entries)
    srcs = data.sources(case.num_sources)
    buf = harness.populate_reference(data, jnp.zeros((args.pool, 32), jnp.uint8), srcs, case.mode, slots2d, pos2d)
    plan = canary_jax.VerifyPlan.from_entries(
        slots=slots2d.reshape(-1), positions=pos2d.reshape(-1), prev_slots=prev2d.reshape(-1)
    )
    tensors = tuple(s.tensor for s in srcs)

    def step(fn):
        def f(log, c):
            return fn(harness.make_context(c[0], log, harness.with_tensors(srcs, c[2]), case.mode), c[1]).log

        return f

    logs = {}
    for name, fn, n in (
        ("pallas_tpu", lambda ctx, p: verify_tpu(ctx, p, interpret=INTERPRET), args.n_verify),
        ("reference", reference.verify_reference, args.n_ref),
    ):
        t, log, info = harness.time_jax(
            step(fn), canary_jax.ViolationLog.allocate(ring_capacity=1024), (buf, plan, tensors), n=n, reps=args.reps
        )
        rec[name] = {"us_per_call": t * 1e6, **info, "write_index": int(log.write_index[0])}
        logs[name] = log
    rec["equal_to_reference"] = all(
        np.array_equal(np.asarray(getattr(logs["pallas_tpu"], f)), np.asarray(getattr(logs["reference"], f)))
        for f in ("ring", "write_index")
    )


def run_write(case, data, args, rec):
    length = case.length
    w = harness.write_inputs(case, data, args, lambda buf, *a: harness.populate_reference(data, buf, *a))
    srcs, tensors, plan, buf0 = w.srcs, w.tensors, w.plan, w.buf0
    consts = (plan, *(harness.int64_pairs(x) for x in (w.ids_np, w.positions, w.slots)), tensors)
    from pallas_kernels.tpu.write import write_tpu

    def step(fn):
        def f(state, c):
            ctx = harness.make_context(state[0], state[1], harness.with_tensors(srcs, c[4]), case.mode)
            out = fn(ctx, c[0], c[1], c[2], c[3])
            return out.canary_buf, out.log

        return f

    # decode: 20x the launches (bench.py's count); the long write (a serial chain of length steps): once
    n, reps = (20 * args.n_write, args.reps) if length == 1 else (1, 1)
    states = {}
    for name, fn in (
        ("pallas_tpu", lambda ctx, *a: write_tpu(ctx, *a, interpret=INTERPRET)),
        ("reference", reference.write_reference),
    ):
        state = (jnp.copy(buf0), canary_jax.ViolationLog.allocate(ring_capacity=1024))
        tp, state, info = harness.time_jax(step(fn), state, consts, n=n, reps=reps)
        rec[name] = {"us_per_call": tp * 1e6, **info, "write_index": int(state[1].write_index[0])}
        states[name] = state
    (buf_p, log_p), (buf_r, log_r) = states["pallas_tpu"], states["reference"]
    rec["equal_to_reference"] = bool(np.array_equal(np.asarray(buf_p), np.asarray(buf_r))) and all(
        np.array_equal(np.asarray(getattr(log_p, f)), np.asarray(getattr(log_r, f)))
        for f in ("ring", "write_index", "slot_run_counters", "kernel_run_counters")
    )


def run_kernel_cases(a, results, dump, hbm):
    args = bench_args(a)
    data = harness.Data(args)
    for case in kernel_case_list(a):
        print(f"[{time.perf_counter() - T0:6.1f}s] {case.id}", flush=True)
        rec = results["cases"].setdefault(case.id, {"case": dataclasses.asdict(case) | {"mode": case.mode.name}})
        rec["needed_bytes"] = harness.needed_bytes(case, args)
        rec["entries"] = args.entries if case.op == "verify" else case.reqs * case.length
        try:
            (run_verify if case.op == "verify" else run_write)(case, data, args, rec)
            key = "pallas_tpu"
            us = rec[key]["us_per_call"]
            rec["gb_s"] = rec["needed_bytes"] / (us * 1e-6) / 1e9 if us > 0 else None
            rec["hbm_frac"] = rec["gb_s"] * 1e9 / hbm if (hbm and rec["gb_s"]) else None
            print(f"  {case.id}: {key} {us:.1f} us", flush=True)
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:800]}"
            traceback.print_exc()
        dump()


def table(results) -> str:
    lines = [
        "| case | pallas_tpu us | reference us | equal | GB/s needed | % of HBM | note |",
        "|---|---|---|---|---|---|---|",
    ]

    def f(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    for cid, r in results["cases"].items():
        p = r.get("pallas_tpu", {}).get("us_per_call")
        ref = r.get("reference", {}).get("us_per_call")
        frac = r.get("hbm_frac")
        note = r.get("error") or ""
        lines.append(
            f"| {cid} | {f(p)} | {f(ref)} | {r.get('equal_to_reference', '-')} | {f(r.get('gb_s'), '{:.0f}')} | "
            f"{f(None if frac is None else 100 * frac)} | {note} |"
        )
    return "\n".join(lines)


T0 = time.perf_counter()


def main(argv=None) -> dict:
    a = parse_args(argv)
    devices = require_tpu()
    os.makedirs(a.out, exist_ok=True)
    env = harness.environment()
    env["device_kind"] = devices[0].device_kind
    env["platform"] = jax.default_backend()
    try:
        env["bytes_limit"] = int(devices[0].memory_stats()["bytes_limit"])
    except Exception:  # noqa: BLE001
        env["bytes_limit"] = None
    hbm = hbm_bytes_per_s(env["device_kind"])
    env["hbm_bytes_per_s_assumed"] = hbm
    print(json.dumps(env), flush=True)
    results: dict = {"environment": env, "args": vars(a), "cases": {}}
    path = os.path.join(a.out, "tpu_bench.json")

    def dump():
        with open(path, "w") as fh:
            json.dump(results, fh, indent=1, default=str)

    run_kernel_cases(a, results, dump, hbm)
    cmds, skipped = serving_plan(a, env["bytes_limit"])
    results["serving_step"] = {"skipped": skipped, "runs": {}}
    for argv_s in cmds:
        from benchmarks.serving_step import cli as ss_cli

        be = argv_s[argv_s.index("--backend") + 1]
        print(f"[{time.perf_counter() - T0:6.1f}s] serving step, backend {be}: {' '.join(argv_s)}", flush=True)
        try:
            out = ss_cli.main(argv_s)
            results["serving_step"]["runs"][be] = {"argv": argv_s, "json": argv_s[-1], "total_s": out.get("total_s")}
        except Exception as e:  # noqa: BLE001
            results["serving_step"]["runs"][be] = {"argv": argv_s, "error": f"{type(e).__name__}: {str(e)[:800]}"}
            traceback.print_exc()
        dump()
    dump()
    md = [
        f"# canary-jax TPU benchmark ({env['date']}, {env['device_kind']})",
        "",
        "Command: `" + " ".join(env["argv"]) + "`",
        "",
        "```",
        json.dumps(env, indent=1),
        "```",
        "",
        table(results),
        "",
        "Serving step: " + json.dumps(results["serving_step"], default=str),
    ]
    with open(os.path.join(a.out, "tpu_bench.md"), "w") as fh:
        fh.write("\n".join(md) + "\n")
    print(table(results))
    return results


if __name__ == "__main__":
    try:
        main()
    except NoTpu as e:
        print(e.code, file=sys.stderr)
        sys.exit(2)
