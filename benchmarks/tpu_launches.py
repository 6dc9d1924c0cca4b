#!/usr/bin/env python3
"""Counts the launches of one canary decode step (plan, HEAD, TAIL; and a sweep) with the ``pallas_tpu`` backend,
lowered for a TPU on any machine: no TPU needed, nothing runs.

The step is the step API (:func:`canary_jax.runtime.step.canary_plan` -> ``canary_head`` -> ``canary_tail``, and
``canary_sweep`` over the batch's whole contexts) at the serving benchmark's decode shapes
(``benchmarks.serving_step.shapes``: Qwen3-0.6B, page size 16, context 4096, layer 0's K array as the TAIL
source, ``read_bytes`` = the whole 2048-byte K row in ALL), inside one ``jax.jit``, exported with
``jax.export(platforms=["tpu"])``. Arguments are ``jax.ShapeDtypeStruct`` s, so no pool is allocated.

Two counts per mode:

* **jaxpr** (``jax.make_jaxpr``): ``pallas_call`` equations, walking into ``pjit`` / ``cond`` / ``switch`` /
  ``while``. A ``switch`` / ``cond`` contributes its *largest* branch (one branch runs per launch: the verify's
  prefix buckets are one branch each), a ``while`` its body once (marked: it runs many times). Also the major
  XLA ops of the executed path (gather, scatter, sort, cumsum, while loops, dynamic slices).
* **StableHLO for the TPU** (the exported module's text): ``tpu_custom_call`` (one per Pallas/Mosaic kernel in
  the program, every switch branch included), ``stablehlo.case`` / ``while`` / ``gather`` / ``scatter`` / ``sort``.
  XLA:TPU's fusion runs only in the TPU compiler, so this is not the number of TPU programs' fused ops.

The TPU kernels are forced compiled (``interpret=False``) for the trace: on a CPU the registry would pick the TPU
interpret mode, whose trace is the interpreter's, not the kernel's.

Usage: ``python -m benchmarks.tpu_launches [--batch 1,128] [--modes none,partial,all] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys

import jax
import jax.extend  # noqa: F401 - jax.extend.core
import jax.numpy as jnp
import numpy as np

from benchmarks.serving_step.shapes import HASH, QWEN3_0_6B, bucket
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.state import CanaryBatch, CanaryState, CanaryStepConfig
from canary_jax.runtime.step import canary_head, canary_plan, canary_sweep, canary_tail
from canary_jax.runtime.sweep import build_sweep_plan_from_requests

PAGE = 16
CONTEXT = 4096
MAJOR = ("gather", "scatter", "scatter-add", "scatter_add", "sort", "cumsum", "cumlogsumexp", "cummax", "argsort",
         "dynamic_slice", "dynamic_update_slice", "while", "cond")  # fmt: skip
HLO_OPS = ("tpu_custom_call", "stablehlo.case", "stablehlo.while", "stablehlo.gather", "stablehlo.scatter",
           "stablehlo.sort", "stablehlo.dynamic_slice", "stablehlo.dynamic_update_slice",
           "stablehlo.reduce")  # fmt: skip


def force_compiled_tpu_kernel() -> None:
    """Traces the TPU verify and write kernels as compiled for a TPU (``interpret=False``) on any host."""
    from pallas_kernels.tpu import verify as tpu_verify
    from pallas_kernels.tpu import write as tpu_write

    tpu_verify.interpret_params = lambda interpret, context, config: False
    tpu_write.interpret_params = lambda interpret, context, config: False


def _subjaxprs(eqn):
    for v in eqn.params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(x, jax.extend.core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jax.extend.core.Jaxpr):
                yield x


def count_path(jaxpr) -> collections.Counter:
    """Primitives on the executed path: the largest branch of each cond / switch (by pallas_call count, then by
    equations), loop bodies once (``while`` itself counted)."""
    c = collections.Counter()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "cond":
            branches = [count_path(b.jaxpr) for b in eqn.params["branches"]]
            c["cond"] += 1
            c += max(branches, key=lambda b: (b["pallas_call"], sum(b.values())))
            continue
        c[name] += 1
        if name == "pallas_call":
            c["pallas_call:" + str(eqn.params.get("name") or "?")] += 1
            continue
        for sub in _subjaxprs(eqn):
            c += count_path(sub)
    return c


PARTS = ("plan", "head", "tail", "sweep")


def step_fn(cfg: CanaryStepConfig, read_bytes: int, sweep_capacity: int | None, upto: str = "sweep"):
    """The step up to and including part ``upto`` (the sweep only with ``sweep_capacity``)."""
    from canary_jax import RealKvSource

    def step(state, b, k0):
        batch = CanaryBatch(
            req_pool_indices=b["rpi"],
            prefix_lens=b["prefix"],
            extend_seq_lens=b["extend"],
            input_ids=b["ids"],
            positions=b["positions"],
            out_cache_loc=b["loc"],
            req_to_token=b["r2t"],
        )
        src = RealKvSource(tensor=k0, page_size=PAGE, num_bytes_per_token=2 * QWEN3_0_6B.kv_dim, read_bytes=read_bytes)
        sources = (((src,), ()),)
        plans = canary_plan(state, batch, config=cfg)
        if upto == "plan":
            return state, plans
        state, plans = canary_head(state, batch, config=cfg, plans=plans)
        if upto == "head":
            return state, plans
        state, summary = canary_tail(state, plans, batch, config=cfg, real_kv_sources=sources)
        if sweep_capacity is not None and upto == "sweep":
            sweep = build_sweep_plan_from_requests(
                req_to_token=b["r2t"], req_pool_indices=b["rpi"], seq_lens=b["lens"], verify_capacity=sweep_capacity
            )
            state = canary_sweep(state, (sweep,), config=cfg, real_kv_sources=sources)
        return state, summary

    return step


def count_step(batch: int, mode: str, *, sweep: bool, backend: str = "pallas_tpu") -> dict:
    m = QWEN3_0_6B
    num_pages = 1 + batch * CONTEXT // PAGE
    num_slots = num_pages * PAGE
    prefix = CONTEXT - 1
    entries = batch * prefix
    cfg = CanaryStepConfig(
        verify_capacity=bucket(entries), write_req_capacity=batch, real_kv_hash_mode=HASH[mode], backend=backend
    )
    group = CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=num_slots, has_v_half=False)
    state = jax.eval_shape(lambda: CanaryState.create([group], ring_capacity=1024))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    b = dict(rpi=i32(batch), prefix=i32(batch), extend=i32(batch), ids=i32(batch), positions=i32(batch),
             loc=i32(batch), r2t=i32(batch + 1, CONTEXT), lens=i32(batch))  # fmt: skip
    k0 = jax.ShapeDtypeStruct((num_pages, PAGE * 2 * m.kv_dim), jnp.bfloat16)
    sweep_cap = bucket(batch * CONTEXT) if sweep else None
    fn = jax.jit(step_fn(cfg, 2 * m.kv_dim, sweep_cap))
    path = count_path(jax.make_jaxpr(fn)(state, b, k0).jaxpr)
    per_part, prev = {}, collections.Counter()
    for part in PARTS if sweep else PARTS[:3]:
        cum = count_path(jax.make_jaxpr(step_fn(cfg, 2 * m.kv_dim, sweep_cap, part))(state, b, k0).jaxpr)
        d = cum - prev
        per_part[part] = {"pallas_call": d["pallas_call"], **{k: d[k] for k in MAJOR if d[k]}}
        prev = cum
    text = jax.export.export(fn, platforms=["tpu"])(state, b, k0).mlir_module()
    hlo = {op: len(re.findall(re.escape(op) + r"\b", text)) for op in HLO_OPS}
    return {
        "batch": batch,
        "mode": mode,
        "sweep": sweep,
        "verify_capacity": cfg.verify_capacity,
        "verify_entries": entries,
        "path_pallas_call": path["pallas_call"],
        "path_kernels": {k.split(":", 1)[1]: v for k, v in path.items() if k.startswith("pallas_call:")},
        "path_major_ops": {k: path[k] for k in MAJOR if path[k]},
        "path_equations": sum(v for k, v in path.items() if ":" not in k),
        "path_per_part": per_part,
        "tpu_stablehlo": hlo,
    }


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,128")
    ap.add_argument("--modes", default="none,partial,all")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    force_compiled_tpu_kernel()
    out = []
    for bs in [int(x) for x in a.batch.split(",")]:
        for mode in a.modes.split(","):
            for sweep in (False, True):
                r = count_step(bs, mode, sweep=sweep)
                out.append(r)
                print(json.dumps(r), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            argv = ["python", "-m", "benchmarks.tpu_launches", *sys.argv[1:]]
            json.dump({"argv": argv, "jax": jax.__version__, "results": out}, fh, indent=1)
    return out


if __name__ == "__main__":
    np.set_printoptions(linewidth=200)
    main()
