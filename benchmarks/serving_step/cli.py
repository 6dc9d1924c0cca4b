"""The command line: flags, the run of the chosen scenarios (JSON written after each stage), ``--merge``, the
environment record."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
import traceback

import jax

from benchmarks import harness
from benchmarks.serving_step.attention import choose_attention
from benchmarks.serving_step.batch import shared_shapes
from benchmarks.serving_step.model import allocate_pool, init_params
from benchmarks.serving_step.report import tables
from benchmarks.serving_step.scenario import run_scenario
from benchmarks.serving_step.shapes import MODES, QWEN3_0_6B, SCENARIOS, SMALL_MODEL, scenarios
from benchmarks.serving_step.timing import log
from benchmarks.serving_step.write_bench import write_bench


def environment() -> dict:
    env = harness.environment()
    try:
        import importlib.metadata as md

        for pkg in ("jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "nvidia-cudnn-cu13"):
            try:
                env[pkg] = md.version(pkg)
            except md.PackageNotFoundError:
                pass
    except Exception:  # noqa: BLE001
        pass
    env["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    env["backend"] = jax.default_backend()
    return env


def merge(paths: list[str]) -> dict:
    out: dict = {"merged_from": paths, "scenarios": {}}
    for p in paths:
        if not os.path.exists(p):
            print(f"merge: {p} missing (skipped)")
            continue
        with open(p) as fh:
            d = json.load(fh)
        for k, v in d.items():
            if k == "scenarios":
                out["scenarios"].update(v)
            elif k not in out:
                out[k] = v
    return out


def parse_args(argv=None):
    from benchmarks import serving_step  # the package's docstring (fully imported by the time this runs)

    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.serving_step", description=serving_step.__doc__.splitlines()[0]
    )
    ap.add_argument("--scenario", default="all", help="decode1, decode128, prefill, write4096, all (comma list ok)")
    ap.add_argument("--modes", default="off,none,partial,all")
    ap.add_argument("--json", default=None, help="output path (default $OUT/serving_step.json or ./)")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per mode (default 5, small 2)")
    ap.add_argument("--sweep-interval", type=int, default=4, help="steps between sweeps (0: no sweep)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--read-bytes", type=int, default=0, help="bytes hashed per token in ALL (default: the K row)")
    ap.add_argument("--backend", default=None, help="canary backend (default: pallas on GPU, reference on CPU)")
    ap.add_argument("--attn-decode", choices=("auto", "pallas", "xla"), default="auto")
    ap.add_argument("--attn-prefill", choices=("auto", "cudnn", "xla"), default="auto")
    ap.add_argument("--parts", default="all", help="scenarios whose parts are timed as their own programs, or none")
    ap.add_argument("--profile", dest="profile", action="store_true", default=None)
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip profiles / parts once this many s passed")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--merge", nargs="*", default=None, help="merge these JSON files (no run)")
    ap.add_argument(
        "--pool-for",
        choices=("all", "chosen"),
        default="all",
        help="size the KV pool for every scenario (default: one pool, compiles shared) or only the chosen ones "
        "(a device with less memory than the largest scenario's pool, e.g. a TPU)",
    )
    ap.add_argument(
        "--pallas-config",
        default=None,
        help="JSON of PallasConfig fields that replace the defaults for every Pallas launch of the run "
        "(e.g. '{\"write_fused_max_tokens\": 128}')",
    )
    a = ap.parse_args(argv)
    a.modes = [x.strip() for x in a.modes.split(",") if x.strip()]
    bad = [x for x in a.modes if x not in MODES]
    if bad:
        ap.error(f"unknown modes {bad}")
    names = [x.strip() for x in a.scenario.split(",")]
    if "all" in names:
        names = [*SCENARIOS, "write4096"]
    bad = [x for x in names if x not in (*SCENARIOS, "write4096")]
    if bad:
        ap.error(f"unknown scenarios {bad}")
    a.scenarios = names
    if a.rounds is None:
        a.rounds = 2 if a.small else 5
    if a.json is None:
        a.json = os.path.join(os.environ.get("OUT", "."), "serving_step.json")
    if a.trace_dir is None:
        a.trace_dir = os.path.join(tempfile.gettempdir(), f"serving_step_traces_{os.getpid()}")
    return a


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.merge is not None:
        out = merge(args.merge)
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1, default=str)
        print(tables(out))
        return out
    harness.apply_pallas_config(args.pallas_config)
    t0 = time.perf_counter()
    on_gpu = jax.default_backend() == "gpu"
    if args.profile is None:
        args.profile = on_gpu
    env = environment()
    print(json.dumps(env), flush=True)
    m = SMALL_MODEL if args.small else QWEN3_0_6B
    out: dict = {"environment": env, "args": {k: v for k, v in vars(args).items()}, "scenarios": {}}
    out["model"] = dict(dataclasses.asdict(m), params=m.params, weight_bytes=m.weight_bytes)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)) or ".", exist_ok=True)

    def dump():
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1, default=str)

    model_scns = [s for s in args.scenarios if s != "write4096"]
    if model_scns:
        attn, info = choose_attention(args, on_gpu, t0)
        out["attention"] = {"decode": attn.decode, "prefill": attn.prefill, **info}
        all_scns = scenarios(args.small)
        pool_scns = all_scns if args.pool_for == "all" else {k: all_scns[k] for k in model_scns}
        sh = shared_shapes(pool_scns, args.page_size)
        num_pages = sh.num_pages
        params = init_params(m, args.seed)
        kv = allocate_pool(m, num_pages, args.page_size, args.seed)
        jax.block_until_ready((params, kv))
        log(f"params ({m.params / 1e6:.0f}M) and pool ({num_pages} pages x {m.layers} layers x K,V) ready", t0)
        for name in model_scns:
            sres = out["scenarios"][name] = {}
            try:
                _, kv = run_scenario(all_scns[name], m, params, kv, attn, args, t0, sh, sres, dump)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                sres["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                if any(a.is_deleted() for a in jax.tree.leaves(kv)):  # donated by the failed call
                    kv = allocate_pool(m, num_pages, args.page_size, args.seed)
            dump()
    if "write4096" in args.scenarios:
        try:
            out["write4096"] = write_bench(args, t0)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            out["write4096"] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
    out["total_s"] = time.perf_counter() - t0
    dump()
    print(tables(out), flush=True)
    return out
