#!/usr/bin/env python3
"""Compile the Pallas kernels' Triton IR for the H100/H200 (sm_90) on a machine without a GPU, and report
compile time per Triton pass stage, registers, spills and memory instructions.

Why: on the H200 a write program took tens of seconds to compile (``benchmarks/results/2026-11-30_h200_pallas.md``,
"Compile time"), which kept the shared suite from running compiled there. This probe finds out offline where
that time goes, without device time.

How:

1. Lower ``write_pallas`` / ``verify_pallas`` for the ``cuda`` platform on the CPU (``jax.jit(...).trace(...)
   .lower(lowering_platforms=("cuda",))``) with ``pallas_call(debug=True)``, which prints each kernel's
   Triton IR (TTIR);
2. strip the printed locations and compile each TTIR with the ``triton`` package (``triton.compile`` for
   ``GPUTarget("cuda", 90, 32)``; ``MLIR_ENABLE_TIMING=1`` gives the per-pass times);
3. run the ``ptxas`` that the triton wheel carries with ``-v`` for registers and spills.

The triton package is not a dependency of canary-jax; install it in a separate environment
(``pip install triton==3.6.0``, the version on our H200 image) and run this script with
``--triton-python PATH`` pointing at that environment's python (the lowering runs here, the compile there).
XLA on the GPU compiles the same TTIR with its own bundled Triton, so absolute times differ from the GPU
host's; compare variants within one run.

Usage (from the repository root):
  python -m benchmarks.compile_probe --triton-python ENV/bin/python --op write --sources 0 \\
      --config '{"write_prefetch": 8}' --kernel canary_write_chain --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import re
import subprocess
import time

_COMPILE = r"""
import json, sys, time, triton
from triton.backends.compiler import GPUTarget
path, warps = sys.argv[1], int(sys.argv[2])
t = time.perf_counter()
k = triton.compile(path, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 1})
dt = time.perf_counter() - t
open(path + ".ptx", "w").write(k.asm["ptx"])
print(json.dumps({"compile_s": dt, "shared_bytes": k.metadata.shared}))
"""


def lower_ttir(op: str, sources: int, config: dict, write_reqs: int = 64, write_tokens: int = 64) -> dict[str, str]:
    """TTIR text of every pallas_call of one ``op`` launch (small shapes; the IR does not depend on sizes)."""
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl

    import canary_jax
    from canary_jax.contract import ints
    from pallas_kernels import verify, write
    from pallas_kernels.config import PallasConfig

    orig = pl.pallas_call
    pl.pallas_call = functools.partial(orig, debug=True)
    try:
        n = 4096
        src = canary_jax.RealKvSource(
            tensor=jnp.zeros((n, 256), jnp.uint8), page_size=1, num_bytes_per_token=256, read_bytes=256
        )
        mode = canary_jax.RealKvHashMode.ALL if sources else canary_jax.RealKvHashMode.NONE
        ctx = canary_jax.VerifyOrWriteContext(
            canary_buf=jnp.zeros((n, 32), jnp.uint8),
            kernel_kind=canary_jax.CanaryLaunchTag.TAIL_K_FULL,
            log=canary_jax.ViolationLog.allocate(ring_capacity=64),
            real_kv_sources=(src,) * sources,
            real_kv_hash_mode=mode,
        )
        cfg = PallasConfig(**config)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            if op == "write":
                per = write_tokens // write_reqs
                plan = canary_jax.WritePlan.from_requests(counts=[per] * write_reqs, seed_slots=[-1] * write_reqs)
                ids = jnp.asarray(ints.int64_to_pairs_np(np.arange(write_tokens, dtype=np.int64)))
                write._write_jit.trace(
                    ctx, plan, ids, ids, ids, None, None, assert_inputs=False, interpret=False, config=cfg
                ).lower(lowering_platforms=("cuda",))
            else:
                plan = canary_jax.VerifyPlan.from_entries(
                    slots=np.arange(1, 65), positions=np.arange(64), prev_slots=np.arange(64) - 1
                )
                verify._verify_jit.trace(ctx, plan, check=False, interpret=False, config=cfg).lower(
                    lowering_platforms=("cuda",)
                )
    finally:
        pl.pallas_call = orig
    out = {}
    for chunk in re.split(r"(?=^module @)", buf.getvalue(), flags=re.M):
        if not chunk.startswith("module @"):
            continue
        name = re.match(r"module @(\w+)", chunk).group(1)
        lines = []
        for line in chunk.splitlines():
            line = re.sub(r' \[unknown\]| \[[^]"]*"[^]]*\]| "[^"]*"\(#loc\d*\)| loc\([^)]*\)', "", line)
            if line.startswith("#loc") or re.match(r"^ *at #loc\d*$", line):
                continue
            lines.append(line)
            if line == "}":
                break
        out[name] = "\n".join(lines) + "\n"
    return out


def sass_loops(nvdisasm: str, cubin: str) -> list[dict]:
    """Per backward-branch loop of a cubin: instruction count, opcode counts and the sum of the static stall
    counts that ptxas wrote into the sm_90 control bits (bits 41..44 of each instruction's second word).

    A warp alone on its scheduler needs at least that many cycles per trip; waits on scoreboards (memory and
    other variable-latency results) come on top. It ranks variants of a latency-bound loop (the write chain)
    offline; the GPU timing decides.
    """
    text = subprocess.run([nvdisasm, "-hex", "-c", cubin], capture_output=True, text=True, check=True).stdout
    lines = text.splitlines()
    ins, labels, pending = [], {}, []
    for k, line in enumerate(lines):
        m = re.match(r"^\.(L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);\s*/\* (0x[0-9a-f]+) \*/", line)
        if m and k + 1 < len(lines):
            ctrl = re.match(r"\s*/\* (0x[0-9a-f]+) \*/", lines[k + 1])
            addr = int(m.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            ins.append((addr, m.group(2).strip(), int(ctrl.group(1), 16) if ctrl else 0))
    loops = []
    for addr, txt, _ in ins:
        mb = re.search(r"BRA `\(\.(L_x_\d+)\)", txt)
        if mb and labels.get(mb.group(1), addr + 1) < addr:
            lo = labels[mb.group(1)]
            body = [(t, c) for a_, t, c in ins if lo <= a_ <= addr]
            ops = {}
            for t, _ in body:
                op = (t.split()[1] if t.startswith("@") else t.split()[0]).split(".")[0]
                ops[op] = ops.get(op, 0) + 1
            loops.append(
                {
                    "start": hex(lo),
                    "instructions": len(body),
                    "stall_cycles": sum((c >> 41) & 0xF for _, c in body),
                    "scoreboard_waits": sum(1 for _, c in body if (c >> 52) & 0x3F),
                    "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:10]),
                }
            )
    return loops


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--triton-python", required=True, help="python of an environment with triton installed")
    ap.add_argument("--op", choices=("write", "verify"), default="write")
    ap.add_argument("--sources", type=int, default=0, help="real-KV sources (ALL mode, 256-byte rows)")
    ap.add_argument("--config", default="{}", help="JSON PallasConfig overrides")
    ap.add_argument(
        "--write-shape",
        default="64x1",
        help="write launch shape REQUESTSxTOKENS_EACH (the long-request role is compiled in for e.g. 1x4096)",
    )
    ap.add_argument("--kernel", default="", help="only this pallas_call name (default: all)")
    ap.add_argument("--timing", action="store_true", help="MLIR_ENABLE_TIMING=1: per-pass times in the log")
    ap.add_argument(
        "--sass",
        action="store_true",
        help="disassemble (nvdisasm -hex) and report each loop's instructions and static stall cycles",
    )
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    config = json.loads(a.config)
    reqs, each = (int(v) for v in a.write_shape.split("x"))
    ttir = lower_ttir(a.op, a.sources, config, write_reqs=reqs, write_tokens=reqs * each)
    from pallas_kernels.config import PallasConfig

    cfg = PallasConfig(**config)
    warps = {
        "canary_write_chain": cfg.write_num_warps,
        "canary_verify": cfg.verify_num_warps,
        "canary_verify_rows": cfg.verify_num_warps,
        "canary_write_long": cfg.write_num_warps,
    }
    ptxas = subprocess.run(
        [
            a.triton_python,
            "-c",
            "import triton, os; print(os.path.join(os.path.dirname("
            "triton.__file__), 'backends', 'nvidia', 'bin', 'ptxas'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    rows = []
    for name, text in ttir.items():
        if a.kernel and name != a.kernel:
            continue
        path = os.path.join(a.out, f"{a.op}_{a.sources}_{name}.ttir")
        with open(path, "w") as f:
            f.write(text)
        env = dict(os.environ, TRITON_ALWAYS_COMPILE="1", MLIR_ENABLE_TIMING="1" if a.timing else "0")
        t = time.perf_counter()
        res = subprocess.run(
            [a.triton_python, "-c", _COMPILE, path, str(warps.get(name, 4))], capture_output=True, text=True, env=env
        )
        wall = time.perf_counter() - t
        with open(path + ".log", "w") as f:
            f.write(res.stdout + res.stderr)
        row = {
            "kernel": name,
            "ttir_ops": text.count(" = ") + text.count("tt.store"),
            "tt_load": text.count("tt.load"),
            "tt_store": text.count("tt.store"),
            "wall_s": round(wall, 1),
        }
        if res.returncode != 0:
            row["error"] = (res.stderr.strip().splitlines() or ["?"])[-1][:200]
        else:
            row.update(json.loads(res.stdout.strip().splitlines()[-1]))
            row["compile_s"] = round(row["compile_s"], 1)
            v = subprocess.run(
                [ptxas, "-arch=sm_90a", "-v", path + ".ptx", "-o", path + ".cubin"], capture_output=True, text=True
            ).stderr
            m = re.search(r"Used (\d+) registers", v)
            sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", v)
            row["registers"] = int(m.group(1)) if m else None
            row["spill_bytes"] = [int(sp.group(1)), int(sp.group(2))] if sp else None
            ptx = open(path + ".ptx").read()
            row["ld_global"] = len(re.findall(r"\bld\.global", ptx))
            row["st_global"] = len(re.findall(r"\bst\.global", ptx))
            if a.sass:
                row["loops"] = sass_loops(os.path.join(os.path.dirname(ptxas), "nvdisasm"), path + ".cubin")
            if a.timing:
                passes = re.findall(r"^\s+([\d.]+) \(\s*([\d.]+)%\)\s+(\w+)$", res.stdout + res.stderr, flags=re.M)
                top = sorted(((float(t_), p) for t_, _, p in passes if p != "Total"), reverse=True)[:3]
                row["top_passes_s"] = [[p, round(t_, 1)] for t_, p in top]
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(a.out, "compile_probe.json"), "w") as f:
        json.dump({"op": a.op, "sources": a.sources, "config": config, "kernels": rows}, f, indent=1)


if __name__ == "__main__":
    main()
