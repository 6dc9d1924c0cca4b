#!/usr/bin/env python3
"""Offline sm_90 compile of ``canary_phase`` and ``canary_write_fused`` with the small write body
(:mod:`pallas_kernels.write_small`) and without it (``write_small_max_tokens=0``): compile seconds, PTX size,
global loads / stores and barriers (:func:`benchmarks.ptx_inspect.ptx_static`), and ptxas's registers and spills.
No GPU: the Triton IR is lowered here and compiled by the ``triton`` package's compiler and ptxas
(``interop.native.triton_kernels``), each kernel in fresh caches so the time is a real compile.

Run with a python that has ``triton`` (the lowering and compile both run in it):
  python -m benchmarks.write_small_probe [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import canary_jax
from benchmarks.ptx_inspect import parse_ptxas, ptx_static
from pallas_kernels import phase, write_fused
from pallas_kernels.config import PallasConfig

N_SLOTS = 4096


def _launch(tokens: int, reqs: int, source: bool):
    """A decode-shaped launch: ``reqs`` request rows of ``tokens // reqs`` tokens, a 48-byte PARTIAL source."""
    rng = np.random.default_rng(0)
    src = canary_jax.RealKvSource(
        tensor=jnp.zeros((N_SLOTS, 48), jnp.uint8), page_size=1, num_bytes_per_token=48, read_bytes=48
    )
    ctx = canary_jax.VerifyOrWriteContext(
        canary_buf=jnp.zeros((N_SLOTS, 32), jnp.uint8),
        kernel_kind=canary_jax.CanaryLaunchTag.TAIL_K_FULL,
        log=canary_jax.ViolationLog.allocate(ring_capacity=1024),
        real_kv_sources=(src,) if source else (),
        real_kv_hash_mode=canary_jax.RealKvHashMode.PARTIAL if source else canary_jax.RealKvHashMode.NONE,
    )
    per = tokens // reqs
    wplan = canary_jax.WritePlan.from_requests(counts=[per] * reqs, seed_slots=[-1] * reqs, write_req_capacity=reqs)
    vplan = canary_jax.VerifyPlan.from_entries(
        slots=rng.integers(1, N_SLOTS, 1024), positions=np.zeros(1024, int), prev_slots=-np.ones(1024, int)
    )
    tok = jnp.asarray(rng.integers(0, 1000, (tokens, 2)).astype(np.uint32))
    return ctx, vplan, wplan, tok


def _eqn(kernel: str, tokens: int, reqs: int, source: bool, config: PallasConfig):
    ctx, vplan, wplan, tok = _launch(tokens, reqs, source)

    if kernel == "canary_phase":

        def run(c):
            kw = dict(check=True, assert_inputs=True, interpret=False, config=config)
            return phase._phase(c, vplan, wplan, tok, tok, tok, tok, tok, **kw)

    else:

        def run(c):
            from pallas_kernels import calls, write

            pro = calls.prologue(c, config, False)
            flat = write.flat_operands(tok, tok, tok, tok, tok, assert_inputs=True)
            return write_fused.write_fused(pro, wplan, flat, assert_inputs=True, interpret=False, config=config)

    eqns = [e for e in jax.make_jaxpr(run)(ctx).jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert [e.params["name"] for e in eqns] == [kernel], [e.params["name"] for e in eqns]
    return eqns[0]


def _ptxas(ptx: str) -> dict:
    import triton

    exe = shutil.which("ptxas") or os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run(
            [exe, "-v", "--gpu-name", "sm_90a", path, "-o", os.path.join(d, "k.cubin")],
            capture_output=True,
            text=True,
            check=False,
        )
    return parse_ptxas(out.stdout + out.stderr)


def measure(kernel: str, tokens: int, reqs: int, source: bool, small: bool) -> dict:
    """One kernel compiled for sm_90 in fresh caches: seconds, PTX counts, registers."""
    from interop.native import triton_kernels as tk
    from interop.native import triton_ttir as tt

    config = PallasConfig(write_small_max_tokens=128 if small else 0)
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as tcache:
        os.environ[tt.CACHE_ENV], os.environ["TRITON_CACHE_DIR"] = cache, tcache
        tt.clear_memo()
        spec = tt.kernel_spec(_eqn(kernel, tokens, reqs, source, config))
        compiled, seconds = tk._compile(spec, 90)
    ptx = compiled.asm["ptx"]
    static = ptx_static(ptx)
    return dict(
        kernel=kernel,
        tokens=tokens,
        reqs=reqs,
        source=source,
        small=small,
        compile_s=round(seconds, 2),
        **{k: static[k] for k in ("ptx_lines", "ld_global", "st_global", "bar_sync")},
        **_ptxas(ptx),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    rows = []
    for kernel in ("canary_phase", "canary_write_fused"):
        for tokens, reqs in ((1, 1), (128, 128)):
            for source in (False, True):
                for small in (False, True):
                    row = measure(kernel, tokens, reqs, source, small)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
