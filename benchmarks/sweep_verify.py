#!/usr/bin/env python3
"""Sweeps PallasConfig variants of the Pallas verify kernel on bench.py's verify scenario, in one process.

Why: verify with real-KV sources (ALL x4 over 1M entries) took 1442 to 2200 us on the H200 against 1161 us
for the CUDA peer (``benchmarks/results/2026-11-30_h200_pallas.md``). This script times block shapes, warps,
gathers and the real-KV loop unroll on the same data, checks every variant against the jnp reference, and
(``--ptx``) records registers, spills and stack of the Triton kernels with ``ptxas -v``.

Scenario (built once per mode, with ``bench.Data`` / ``bench.populate``): ``--pool`` slots (default 4M),
``--entries`` verify entries (default 1M, a multiple of 1024) in request-major chains of 1024 random slots,
sources of 256-byte rows; ``--modes`` any of ``all_x4`` (default), ``partial_x4``, ``all_x1``.

Per variant and mode:

* ``first_call_s``: compile + first call of ``verify_pallas`` (jit, this config), on a *corrupted* copy of
  the scenario (flipped token / position / real-KV-field bytes in the canary and flipped source bytes, so
  about 1.25 rows per corruption overflow a 256-row ring). Its log (ring, write_index, both counters) must
  equal the reference's on the same input byte for byte (``equal_corrupt``).
* ``us_per_call`` from ``bench.time_jax`` (jitted ``fori_loop`` of ``--n`` donated launches, minus an empty
  program, median over ``--reps``; ``loop_compile_s`` is its compile + first run) on the clean data; the
  final log of all those launches must equal the reference's after the same number of launches
  (``equal_clean``). GB/s of bench's needed bytes and % of 4.8 TB/s.
* ``--ptx DIR``: the PTX of ``canary_verify`` and ``canary_verify_rows`` as the Pallas Triton lowering
  produced it (captured by wrapping ``jax._src.lib.triton.compile``), written to ``DIR/<variant>/``, and
  ``ptxas -v`` on it (registers, spill bytes, stack, smem), ``cuobjdump -sass`` of the cubin, static PTX
  counts (global loads by width, shared-memory traffic, barriers) and a theoretical occupancy. Done for every
  measured variant (it is cheap), so it covers the default and the best one. ``DIR`` can be scratch space:
  the PTX, ptxas and SASS text (no cubins) are also packed into ``OUT/sweep_verify_ptx.tar.gz``.

Variants: ``--variants`` takes preset names (comma-separated) or JSON: a list of preset names and/or
override dicts, or a dict ``{name: overrides}``. ``--budget-s`` bounds the whole process (setup included):
no new variant starts when the mean cost of the finished ones would exceed it. A variant that raises is
recorded and skipped. Results: ``OUT/sweep_verify.json`` (rewritten after every variant) and
``OUT/sweep_verify.md``; the table is printed last.

``--single NAMES``: runs only those variants, ``--launches`` plain launches each on the clean data, no
timing loop, no reference (unless ``--check``): the mode to run under Nsight Compute. ``--ncu`` prints the
ncu command for it.

The persistent compile cache is used when ``JAX_COMPILATION_CACHE_DIR`` is set (compile times then reflect
cache hits; the JSON records the directory's presence).

Usage (GPU): ``python3 benchmarks/sweep_verify.py --budget-s 150 --ptx ptx_scratch --out $OUT``.
Dry run (CPU, interpret mode): ``python3 benchmarks/sweep_verify.py --pool 16384 --entries 4096 --n 2
--reps 1 --variants default,b128w4 --out sweep_out``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import dataclasses
import functools
import json
import math
import re
import shutil
import subprocess
import sys
import time
import traceback

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])

import bench  # noqa: E402
import canary_jax  # noqa: E402
from canary_jax import reference  # noqa: E402
from pallas_kernels.config import PallasConfig  # noqa: E402
from pallas_kernels.verify import verify_pallas  # noqa: E402

HBM = bench.HBM_BYTES_PER_S
LOG_FIELDS = ("ring", "write_index", "slot_run_counters", "kernel_run_counters")
MODES = {"all_x4": (bench.ALL, 4), "partial_x4": (bench.PARTIAL, 4), "all_x1": (bench.ALL, 1)}
CORRUPT_RING = 256  # ring rows of the corrupted check: small enough that it overflows (fill-once path)

# Presets; the first DEFAULT_VARIANTS run by default, most informative first.
PRESETS: dict[str, dict] = {
    "default": {},
    "b128w4": dict(verify_source_block=128, verify_num_warps=4),  # one entry per thread
    "b64w2": dict(verify_source_block=64, verify_num_warps=2),  # one entry per thread, smaller programs
    "b256w8": dict(verify_source_block=256, verify_num_warps=8),  # one entry per thread, bigger programs
    "unroll1": dict(source_unroll=1),
    "unroll4": dict(source_unroll=4),
    "sg_word": dict(source_gather="word"),
    "sg_quad": dict(source_gather="quad"),
    "gather_quad": dict(gather="quad"),
    # extras (name them in --variants)
    "unroll0": dict(source_unroll=0),  # straight-line real-KV code: about 50 s of compile on the H200
    "b128w4_unroll4": dict(verify_source_block=128, verify_num_warps=4, source_unroll=4),
    "b128w4_sg_quad": dict(verify_source_block=128, verify_num_warps=4, source_gather="quad"),
    "b128w4_p8192": dict(verify_source_block=128, verify_num_warps=4, verify_max_programs=8192),
    "b64w2_p16384": dict(verify_source_block=64, verify_num_warps=2, verify_max_programs=16384),
    "b512w8": dict(verify_source_block=512, verify_num_warps=8),
    "w8": dict(verify_num_warps=8),
    "w2": dict(verify_num_warps=2),
    "p1056": dict(verify_max_programs=1056),
    "portable": dict(multiplier="portable"),
    "tile_contiguous": dict(source_gather="tile_contiguous"),  # 16-byte loads + shared-memory hand-over
    "tile_contiguous32": dict(source_gather="tile_contiguous", source_tile_words=32),
    "tile32": dict(source_tile_words=32),
}
DEFAULT_VARIANTS = ["default", "b128w4", "b64w2", "b256w8", "unroll1", "unroll4", "sg_word", "sg_quad",
                    "gather_quad"]


def parse_variants(spec: str) -> list[tuple[str, dict]]:
    spec = spec.strip()
    if not spec:
        return [(n, PRESETS[n]) for n in DEFAULT_VARIANTS]
    if spec[0] in "[{":
        obj = json.loads(spec)
        items = list(obj.items()) if isinstance(obj, dict) else obj
    else:
        items = [s for s in spec.split(",") if s]
    out = []
    for it in items:
        if isinstance(it, str):
            if it not in PRESETS:
                raise SystemExit(f"unknown preset {it!r}; presets: {', '.join(PRESETS)}")
            out.append((it, PRESETS[it]))
        elif isinstance(it, dict):
            out.append((",".join(f"{k}={v}" for k, v in it.items()) or "default", dict(it)))
        else:  # (name, overrides) from a JSON dict
            name, kw = it
            out.append((str(name), dict(kw)))
    return out


# --- PTX capture and ptxas ------------------------------------------------------------------------------------
class PtxCapture:
    """Wraps ``jax._src.lib.triton.compile`` (what the Pallas Triton lowering calls on jaxlib > 0.10.2) and
    keeps the PTX of every kernel lowered while ``sink`` is a list."""

    def __init__(self):
        self.sink: list | None = None
        self.error = None
        try:
            from jax._src.lib import triton as jt

            orig = jt.compile

            @functools.wraps(orig)
            def wrapped(*a, **k):
                res = orig(*a, **k)
                if self.sink is not None:
                    try:
                        asm = res.asm
                        asm = asm.decode() if isinstance(asm, bytes) else str(asm)
                        self.sink.append(dict(asm=asm, smem_bytes=int(getattr(res, "smem_bytes", 0) or 0),
                                              num_warps=k.get("num_warps"), num_stages=k.get("num_stages"),
                                              arch=a[2] if len(a) > 2 else k.get("arch_name")))
                    except Exception as e:  # noqa: BLE001
                        self.error = f"capture: {type(e).__name__}: {e}"
                return res

            jt.compile = wrapped
            try:  # a lowering module that imported the function itself
                from jax._src.pallas.triton import pallas_call_registration as reg

                for k, v in list(vars(reg).items()):
                    if v is orig:
                        setattr(reg, k, wrapped)
            except Exception:  # noqa: BLE001
                pass
        except Exception as e:  # noqa: BLE001
            self.error = f"cannot wrap jax._src.lib.triton.compile: {type(e).__name__}: {e}"


def _int(pattern, text, default=None):
    m = re.search(pattern, text)
    return int(m.group(1)) if m else default


def ptx_static(asm: str) -> dict:
    lines = asm.splitlines()
    ld = [ln for ln in lines if re.search(r"\bld\.global", ln)]
    return {
        "ptx_lines": len(lines),
        "ld_global": len(ld),
        "ld_global_v2": sum(".v2" in ln for ln in ld),
        "ld_global_v4": sum(".v4" in ln for ln in ld),
        "st_global": sum(bool(re.search(r"\bst\.global", ln)) for ln in lines),
        "ld_shared": sum(bool(re.search(r"\bld\.shared", ln)) for ln in lines),
        "st_shared": sum(bool(re.search(r"\bst\.shared", ln)) for ln in lines),
        "bar_sync": sum(bool(re.search(r"\bbar\.sync|\bbarrier\.sync", ln)) for ln in lines),
        "maxntid": (re.search(r"\.(?:maxntid|reqntid)\s+([\d, ]+)", asm) or [None, None])[1],
        "maxnreg": _int(r"\.maxnreg\s+(\d+)", asm),
    }


def parse_ptxas(text: str) -> dict:
    out = {}
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if m:
        out.update(stack_bytes=int(m.group(1)), spill_store_bytes=int(m.group(2)), spill_load_bytes=int(m.group(3)))
    out["registers"] = _int(r"Used (\d+) registers", text)
    out["ptxas_smem_bytes"] = _int(r"(\d+) bytes smem", text, 0)
    return out


def occupancy(regs, warps: int, smem_bytes: int) -> dict:
    """Theoretical sm_90 occupancy: 64K registers (256-register warp granules), 64 warps, 32 blocks,
    228 KiB shared memory per SM (1 KiB reserved per block)."""
    if not regs or not warps:
        return {}
    per_warp = math.ceil(regs * 32 / 256) * 256
    by_regs = (65536 // per_warp) // warps
    by_smem = (233472 // (smem_bytes + 1024)) if smem_bytes else 32
    blocks = max(0, min(by_regs, 64 // warps, by_smem, 32))
    return {"blocks_per_sm": blocks, "occupancy": blocks * warps / 64,
            "limit": min((by_regs, "regs"), (64 // warps, "warps"), (by_smem, "smem"), (32, "blocks"))[1]}


def ptx_report(captured: list[dict], out_dir: str, variant: str) -> dict:
    """Writes each captured kernel's PTX and runs ptxas -v (and cuobjdump -sass) on it."""
    rep: dict = {}
    if not captured:
        return {"error": "no PTX captured (CPU/interpret mode, a compile-cache path that skips lowering, or a "
                         "jaxlib that lowers through XLA's triton custom call: use XLA_FLAGS=--xla_dump_to)"}
    vdir = os.path.join(out_dir, re.sub(r"[^A-Za-z0-9_.-]+", "_", variant))
    os.makedirs(vdir, exist_ok=True)
    ptxas = shutil.which("ptxas")
    cuobjdump = shutil.which("cuobjdump")
    for item in captured:
        asm = item["asm"]
        name = (re.search(r"\.entry\s+([A-Za-z_$][\w$]*)", asm) or [None, f"kernel{len(rep)}"])[1]
        if name in rep:
            continue
        path = os.path.join(vdir, name + ".ptx")
        with open(path, "w") as f:
            f.write(asm)
        r = {"smem_bytes": item["smem_bytes"], "num_warps": item["num_warps"], "num_stages": item["num_stages"],
             **ptx_static(asm)}
        target = (re.search(r"\.target\s+(sm_\w+)", asm) or [None, "sm_90"])[1]
        if ptxas is None:
            r["ptxas_error"] = "ptxas not on PATH"
        else:
            cubin = os.path.join(vdir, name + ".cubin")
            for arch in dict.fromkeys((target, "sm_90a", "sm_90")):
                try:
                    p = subprocess.run([ptxas, f"-arch={arch}", "-v", path, "-o", cubin], capture_output=True,
                                       text=True, timeout=180)
                except Exception as e:  # noqa: BLE001
                    r["ptxas_error"] = f"{type(e).__name__}: {e}"
                    break
                text = p.stdout + p.stderr
                if p.returncode == 0:
                    r.update(parse_ptxas(text), ptxas_arch=arch)
                    r.pop("ptxas_error", None)
                    with open(os.path.join(vdir, name + ".ptxas.txt"), "w") as f:
                        f.write(text)
                    break
                r["ptxas_error"] = f"-arch={arch} rc={p.returncode}: {text.strip()[-600:]}"
            if "registers" in r and cuobjdump is not None:
                try:
                    p = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, timeout=120)
                    if p.returncode == 0:
                        with open(os.path.join(vdir, name + ".sass"), "w") as f:
                            f.write(p.stdout)
                        r["sass_ldg"] = len(re.findall(r"\bLDG\.", p.stdout))
                        r["sass_instructions"] = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", p.stdout, re.M))
                except Exception as e:  # noqa: BLE001
                    r["sass_error"] = f"{type(e).__name__}: {e}"
            r.update(occupancy(r.get("registers"), item["num_warps"] or 4,
                               max(item["smem_bytes"], r.get("ptxas_smem_bytes") or 0)))
        rep[name] = r
    return rep


def archive_ptx(src: str, dest: str) -> str:
    """Packs the PTX / ptxas / SASS files (no cubins) of ``src`` into one ``.tar.gz``."""
    import tarfile

    try:
        with tarfile.open(dest, "w:gz") as tar:
            for root, _, files in os.walk(src):
                for fn in sorted(files):
                    if not fn.endswith(".cubin"):
                        path = os.path.join(root, fn)
                        tar.add(path, arcname=os.path.relpath(path, src))
        return f"{dest} ({os.path.getsize(dest)} bytes)"
    except Exception as e:  # noqa: BLE001
        return f"archive failed: {type(e).__name__}: {e}"


# --- scenario ---------------------------------------------------------------------------------------------------
def log_arrays(log) -> dict:
    return {f: np.asarray(getattr(log, f)) for f in LOG_FIELDS}


def log_diff(a: dict, b: dict) -> list[str]:
    """Names of the log fields that differ in dtype, shape or bytes."""
    return [f for f in LOG_FIELDS
            if a[f].dtype != b[f].dtype or a[f].shape != b[f].shape or a[f].tobytes() != b[f].tobytes()]


@dataclasses.dataclass
class Scenario:
    name: str
    case: bench.Case
    srcs: tuple
    buf: jax.Array
    plan: object
    tensors: tuple
    bad_buf: jax.Array
    bad_tensors: tuple
    needed_bytes: float
    ref_bad: dict | None = None
    ref_clean: dict | None = None  # after ref_clean_launches launches
    ref_clean_launches: int = 0
    populated: str = ""


def build(mode_name: str, data: bench.Data, bargs: bench.Args, *, populate: str, corruptions: int) -> Scenario:
    mode, k = MODES[mode_name]
    case = bench.Case(f"verify_{mode_name}", "verify", mode, k)
    # Same inputs as bench.run_verify (it has no hook that returns them).
    e, length = bargs.entries, 1024
    reqs = e // length
    slots2d = data.perm[: reqs * length].reshape(reqs, length)
    pos2d = np.broadcast_to(np.arange(length, dtype=np.int64), (reqs, length))
    prev2d = np.concatenate([np.full((reqs, 1), -1, np.int64), slots2d[:, :-1]], axis=1)
    srcs = data.sources(k)
    buf = jnp.zeros((bargs.pool, 32), jnp.uint8)
    how = populate
    if populate == "pallas":
        try:
            buf, _ = bench.populate(data, buf, srcs, mode, slots2d, pos2d, None)
        except Exception as e:  # noqa: BLE001 - e.g. a write kernel mid-edit: fall back to the jnp reference
            how = f"reference (pallas write failed: {type(e).__name__}: {str(e)[:300]})"
            print(f"  populate: {how}", flush=True)
            populate = "reference"
    if populate == "reference":
        buf = populate_reference(data, buf, srcs, mode, slots2d, pos2d)
    plan = canary_jax.VerifyPlan.from_entries(slots=slots2d.reshape(-1), positions=pos2d.reshape(-1),
                                      prev_slots=prev2d.reshape(-1))
    tensors = tuple(s.tensor for s in srcs)
    # Corrupted copy: four equal groups of distinct entries get a flipped token byte, position byte, stored
    # real-KV-field byte, or a flipped byte inside the hashed part of source 0's row.
    rng = np.random.default_rng(bargs.seed + 1)
    kk = max(4, min(corruptions, e // 16)) // 4 * 4
    ent = rng.choice(e, kk, replace=False)
    slots = slots2d.reshape(-1)[ent].astype(np.int32)
    g = np.array_split(slots, 4)
    bad_buf = buf
    for grp, byte in zip(g[:3], (0, 8, 24)):
        idx = jnp.asarray(grp)
        bad_buf = bad_buf.at[idx, byte].set(bad_buf[idx, byte] ^ jnp.uint8(1))
    eff = 16 if mode == bench.PARTIAL else bench.ROW_BYTES
    offs = jnp.asarray(rng.integers(0, eff, g[3].shape[0]).astype(np.int32))
    t0 = tensors[0]
    rows = jnp.asarray(g[3])
    bad_t0 = t0.at[rows, offs].set(t0[rows, offs] ^ jnp.uint8(0x5A))
    bad_tensors = (bad_t0,) + tensors[1:]
    jax.block_until_ready((buf, bad_buf, bad_t0))
    return Scenario(mode_name, case, srcs, buf, plan, tensors, bad_buf, bad_tensors,
                    bench.needed_bytes(case, bargs), populated=how)


def populate_reference(data, buf, srcs, mode, slots2d, positions2d):
    """``bench.populate`` with the jnp reference write (a fallback that does not need the write kernel)."""
    reqs, length = slots2d.shape
    plan = canary_jax.WritePlan.from_requests(counts=[length] * reqs, seed_slots=[-1] * reqs)
    ids = data.rng.integers(0, 1 << 31, reqs * length)
    ctx = bench._ctx(buf, canary_jax.ViolationLog.allocate(ring_capacity=64), srcs, mode)
    out = jax.jit(reference.write_reference)(ctx, plan, bench._pairs(ids), bench._pairs(positions2d.reshape(-1)),
                                     bench._pairs(slots2d.reshape(-1)))
    assert int(out.log.write_index[0]) == 0
    return out.canary_buf


def steps(sc: Scenario, cfg):
    def step_pallas(log, c):
        return verify_pallas(bench._ctx(c[0], log, bench._with_tensors(sc.srcs, c[2]), sc.case.mode), c[1],
                             config=cfg).log

    def step_ref(log, c):
        return reference.verify_reference(bench._ctx(c[0], log, bench._with_tensors(sc.srcs, c[2]), sc.case.mode), c[1]).log

    return step_pallas, step_ref


def reference_logs(sc: Scenario, launches: int) -> None:
    _, step_ref = steps(sc, None)
    log = canary_jax.ViolationLog.allocate(ring_capacity=CORRUPT_RING)
    sc.ref_bad = log_arrays(jax.jit(step_ref)(log, (sc.bad_buf, sc.plan, sc.bad_tensors)))

    @jax.jit
    def many(s, c):
        return jax.lax.fori_loop(0, launches, lambda i, s_: step_ref(s_, c), s)

    sc.ref_clean = log_arrays(many(canary_jax.ViolationLog.allocate(ring_capacity=1024), (sc.buf, sc.plan, sc.tensors)))
    sc.ref_clean_launches = launches


# --- one variant ------------------------------------------------------------------------------------------------
def measure(sc: Scenario, name: str, kw: dict, a, cap: PtxCapture) -> dict:
    rec: dict = {"variant": name, "mode": sc.name, "overrides": kw}
    t_var = time.perf_counter()
    try:
        cfg = PallasConfig(**kw)
        rec["config"] = dataclasses.asdict(cfg)
        step_pallas, _ = steps(sc, cfg)
        captured: list = []
        cap.sink = captured
        try:
            t0 = time.perf_counter()
            out = jax.block_until_ready(step_pallas(canary_jax.ViolationLog.allocate(ring_capacity=CORRUPT_RING),
                                                    (sc.bad_buf, sc.plan, sc.bad_tensors)))
            rec["first_call_s"] = time.perf_counter() - t0
        finally:
            cap.sink = None
        bad = log_arrays(out)
        rec["violations_corrupt"] = int(bad["write_index"][0])
        if sc.ref_bad is not None:
            d = log_diff(bad, sc.ref_bad)
            rec["equal_corrupt"], rec["diff_corrupt"] = not d, d
        t, log, info = bench.time_jax(step_pallas, canary_jax.ViolationLog.allocate(ring_capacity=1024),
                                      (sc.buf, sc.plan, sc.tensors), n=a.n, reps=a.reps)
        launches = info["n"] * (2 + len(info["wall_s"]))
        rec.update(us_per_call=t * 1e6, loop_compile_s=info["compile_s"], launches=launches,
                   wall_s=info["wall_s"], empty_s=info["empty_s"], n=info["n"])
        rec["ns_per_entry"] = t * 1e9 / a.entries
        rec["gb_s"] = sc.needed_bytes / t / 1e9 if t > 0 else float("inf")
        rec["hbm_pct"] = 100 * rec["gb_s"] * 1e9 / HBM
        clean = log_arrays(log)
        rec["violations_clean"] = int(clean["write_index"][0])
        if sc.ref_clean is not None and sc.ref_clean_launches == launches:
            d = log_diff(clean, sc.ref_clean)
            rec["equal_clean"], rec["diff_clean"] = not d, d
        elif sc.ref_clean is not None:
            rec["diff_clean"] = [f"launch count {launches} != reference's {sc.ref_clean_launches}"]
        if a.ptx:
            t0 = time.perf_counter()
            rec["ptx"] = ptx_report(captured, a.ptx, f"{sc.name}_{name}")
            if cap.error:
                rec["ptx_capture_error"] = cap.error
            rec["ptx_s"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        rec["traceback"] = traceback.format_exc()[-3000:]
        print(f"  {name} [{sc.name}] FAILED: {rec['error'][:400]}", flush=True)
    rec["elapsed_s"] = time.perf_counter() - t_var
    return rec


# --- report -----------------------------------------------------------------------------------------------------
def _f(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


def table(records: list[dict]) -> str:
    base = {r["mode"]: r.get("us_per_call") for r in records if r["variant"] == "default"}
    lines = ["| mode | variant | us/call | GB/s | % HBM | default/this | first call s | loop compile s | regs | "
             "spill st/ld B | stack B | occ (limit) | ld.global v2/v4/all | shared st/ld, bar | equal clean/corrupt "
             "| note |", "|" + "---|" * 16]
    for r in records:
        k = (r.get("ptx") or {}).get("canary_verify", {})
        b = base.get(r["mode"])
        us = r.get("us_per_call")
        eq = f"{r.get('equal_clean', '-')}/{r.get('equal_corrupt', '-')}"
        note = r.get("error") or r.get("skipped") or (r.get("ptx") or {}).get("error") or k.get("ptxas_error") or ""
        lines.append("| " + " | ".join([
            r["mode"], r["variant"], _f(us), _f(r.get("gb_s"), "{:.0f}"), _f(r.get("hbm_pct")),
            _f(b / us if b and us else None, "{:.2f}x"), _f(r.get("first_call_s")), _f(r.get("loop_compile_s")),
            _f(k.get("registers"), "{}"),
            f"{k['spill_store_bytes']}/{k['spill_load_bytes']}" if "spill_store_bytes" in k else "-",
            _f(k.get("stack_bytes"), "{}"),
            f"{k['occupancy']:.2f} ({k['limit']})" if "occupancy" in k else "-",
            f"{k['ld_global_v2']}/{k['ld_global_v4']}/{k['ld_global']}" if "ld_global" in k else "-",
            f"{k['st_shared']}/{k['ld_shared']}, {k['bar_sync']}" if "st_shared" in k else "-",
            eq, note.replace("|", "/").replace("\n", " ")[:120]]) + " |")
    return "\n".join(lines)


def best_of(records: list[dict]) -> dict:
    out = {}
    for r in records:
        if r.get("us_per_call") is None or r.get("equal_clean") is False or r.get("equal_corrupt") is False:
            continue
        if r["mode"] not in out or r["us_per_call"] < out[r["mode"]]["us_per_call"]:
            out[r["mode"]] = {"variant": r["variant"], "us_per_call": r["us_per_call"], "overrides": r["overrides"]}
    return out


NCU_SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "MemoryWorkloadAnalysis")


def ncu_command(variant: str, out: str = "$OUT") -> str:
    rep = f"{out}/ncu_{variant}"
    sec = " ".join(f"--section {s}" for s in NCU_SECTIONS)
    return (f"ncu --target-processes all --kernel-name regex:'^canary_verify$' --launch-skip 1 --launch-count 1 "
            f"--clock-control none {sec} --export {rep} --force-overwrite "
            f"python3 benchmarks/sweep_verify.py --single {variant} --launches 3 --populate none --out {out}/single "
            f"&& ncu --import {rep}.ncu-rep --page details > {rep}.txt")


# --- main -------------------------------------------------------------------------------------------------------
def main():
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variants", default="", help="preset names (comma-separated) or JSON; presets: "
                    + ", ".join(PRESETS) + "; default: " + ",".join(DEFAULT_VARIANTS))
    ap.add_argument("--modes", default="all_x4", help="comma-separated: " + ", ".join(MODES))
    ap.add_argument("--budget-s", type=float, default=150.0, help="whole-process budget, setup included")
    ap.add_argument("--pool", type=int, default=1 << 22)
    ap.add_argument("--entries", type=int, default=1 << 20, help="a multiple of 1024")
    ap.add_argument("--n", type=int, default=20, help="launches per timed program")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--corruptions", type=int, default=256, help="corrupted entries of the equality check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ptx", default="", metavar="DIR", help="write PTX / ptxas -v / SASS of each variant here (scratch; also archived into OUT)")
    ap.add_argument("--ncu", action="store_true", help="print the ncu command for --single and exit")
    ap.add_argument("--single", default="", metavar="NAMES", help="only these variants, plain launches (for ncu)")
    ap.add_argument("--launches", type=int, default=3, help="plain launches per variant in --single")
    ap.add_argument("--check", action="store_true", help="--single: also check against the reference")
    ap.add_argument("--populate", choices=("pallas", "reference", "none"), default="pallas",
                    help="how the clean chains are written: bench.populate (Pallas write; falls back to the "
                         "reference if it raises), the jnp reference write, or not at all (saves the write "
                         "compile; canary_verify does the same loads and hashing either way, but every entry then "
                         "fails and the rows kernel works)")
    a = ap.parse_args()
    if a.entries % 1024 or a.entries <= 0:
        raise SystemExit("--entries must be a positive multiple of 1024")
    if a.entries >= a.pool:
        raise SystemExit("--entries must be below --pool")
    if a.ncu:
        names = [n for n, _ in parse_variants(a.single or "default,b128w4")]
        for n in names:
            print(ncu_command(n))
        return
    os.makedirs(a.out, exist_ok=True)
    if a.ptx:
        os.makedirs(a.ptx, exist_ok=True)
    env = bench.environment()
    env["compile_cache_dir_set"] = bool(os.environ.get("JAX_COMPILATION_CACHE_DIR"))
    env["backend"] = jax.default_backend()
    env["tools"] = {t: bool(shutil.which(t)) for t in ("ptxas", "cuobjdump", "ncu", "nvcc")}
    print(json.dumps(env), flush=True)
    cap = PtxCapture()
    single = bool(a.single)
    variants = parse_variants(a.single if single else a.variants)
    bargs = bench.Args(pool=a.pool, entries=a.entries, long_tokens=0, decode_reqs=0, reps=a.reps, n_verify=a.n,
                       n_write=0, n_ref=0, n_peer=0, seed=a.seed, only="", ref_x64_on=False, skip_reference=False)
    results: dict = {"environment": env, "args": vars(a), "variants": variants, "records": [],
                     "capture_error": cap.error}
    records = results["records"]
    out_json = os.path.join(a.out, "sweep_verify.json")

    def dump():
        results["best"] = best_of(records)
        results["total_s"] = time.perf_counter() - t_start
        with open(out_json, "w") as f:
            json.dump(results, f, indent=1, default=str)

    def stamp():
        return f"[{time.perf_counter() - t_start:6.1f}s]"

    data = bench.Data(bargs)
    print(f"{stamp()} data ready", flush=True)
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; modes: {', '.join(MODES)}")
    done_s: list[float] = []
    stopped = False
    for mode_name in modes:
        t0 = time.perf_counter()
        est = float(np.mean(done_s)) if done_s else 0.0
        if not single and (stopped or (done_s and t0 - t_start + est > a.budget_s)):
            stopped = True
            records.extend({"variant": name, "mode": mode_name, "overrides": kw,
                            "skipped": f"budget: {t0 - t_start:.0f}s elapsed before this mode's setup"}
                           for name, kw in variants)
            continue
        try:
            sc = build(mode_name, data, bargs, populate=a.populate, corruptions=a.corruptions)
            if not single or a.check:
                reference_logs(sc, a.n * (2 + a.reps))
        except Exception as e:  # noqa: BLE001
            results.setdefault("setup_errors", {})[mode_name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            dump()
            continue
        results.setdefault("setup_s", {})[mode_name] = time.perf_counter() - t0
        results.setdefault("populated", {})[mode_name] = sc.populated
        print(f"{stamp()} {mode_name}: scenario + reference ready ({time.perf_counter() - t0:.1f}s)", flush=True)
        if single:
            for name, kw in variants:
                cfg = PallasConfig(**kw)
                step_pallas, _ = steps(sc, cfg)
                captured: list = []
                cap.sink = captured
                log = canary_jax.ViolationLog.allocate(ring_capacity=1024)
                walls = []
                for i in range(a.launches):
                    t = time.perf_counter()
                    log = jax.block_until_ready(step_pallas(log, (sc.buf, sc.plan, sc.tensors)))
                    walls.append(time.perf_counter() - t)
                    cap.sink = None
                entries = sorted({(re.search(r"\.entry\s+(\w+)", c["asm"]) or [None, "?"])[1] for c in captured})
                rec = {"variant": name, "mode": mode_name, "overrides": kw, "single_wall_s": walls,
                       "kernels": entries, "violations_clean": int(np.asarray(log.write_index)[0])}
                if a.check:
                    bad = step_pallas(canary_jax.ViolationLog.allocate(ring_capacity=CORRUPT_RING),
                                      (sc.bad_buf, sc.plan, sc.bad_tensors))
                    rec["diff_corrupt"] = log_diff(log_arrays(bad), sc.ref_bad)
                    rec["equal_corrupt"] = not rec["diff_corrupt"]
                records.append(rec)
                print(f"{stamp()} single {name} [{mode_name}]: kernels {entries}, wall per launch "
                      f"{', '.join(f'{w * 1e3:.2f} ms' for w in walls)}", flush=True)
            dump()
            continue
        for name, kw in variants:
            elapsed = time.perf_counter() - t_start
            est = float(np.mean(done_s)) if done_s else 0.0
            if stopped or (done_s and elapsed + est > a.budget_s):
                stopped = True
                records.append({"variant": name, "mode": mode_name, "overrides": kw,
                                "skipped": f"budget: {elapsed:.0f}s elapsed + ~{est:.0f}s > {a.budget_s:.0f}s"})
                continue
            print(f"{stamp()} {mode_name} {name} {kw}", flush=True)
            rec = measure(sc, name, kw, a, cap)
            if "error" not in rec:
                done_s.append(rec["elapsed_s"])
            records.append(rec)
            k = (rec.get("ptx") or {}).get("canary_verify", {})
            print(f"{stamp()}   -> {_f(rec.get('us_per_call'))} us, {_f(rec.get('gb_s'), '{:.0f}')} GB/s, first "
                  f"call {_f(rec.get('first_call_s'))} s, loop compile {_f(rec.get('loop_compile_s'))} s, equal "
                  f"clean/corrupt {rec.get('equal_clean')}/{rec.get('equal_corrupt')} "
                  f"(violations {rec.get('violations_corrupt')}), regs {k.get('registers', '-')}, spills "
                  f"{k.get('spill_store_bytes', '-')}", flush=True)
            dump()
        del sc
    dump()
    if single:
        print(f"total {time.perf_counter() - t_start:.1f}s")
        return
    if a.ptx:
        results["ptx_archive"] = archive_ptx(a.ptx, os.path.join(a.out, "sweep_verify_ptx.tar.gz"))
        dump()
    tab = table(records)
    best = best_of(records)
    md = [f"# Pallas verify config sweep ({env['date']})", "", "```", json.dumps(env, indent=1), "```", "",
          f"pool {a.pool}, entries {a.entries}, n {a.n}, reps {a.reps}, budget {a.budget_s:.0f}s; total "
          f"{time.perf_counter() - t_start:.1f}s. `default/this` > 1 means faster than the default. Registers, "
          "spills, occupancy and PTX counts are for `canary_verify` (ptxas -v on the captured PTX).", "", tab, "",
          "best: " + json.dumps(best)]
    with open(os.path.join(a.out, "sweep_verify.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"total {time.perf_counter() - t_start:.1f}s")
    print("best: " + json.dumps(best))
    print(tab)


if __name__ == "__main__":
    main()
