"""The cost a user pays per served step (issue #17): a decoder with Qwen3-0.6B's shapes over a paged bf16 KV
pool, with the KV canary inside the same jitted step.

The model: 28 layers, hidden 1024, 16 query heads, 8 KV heads, head dim 128, SwiGLU MLP 3072, vocabulary 151936
(tied embeddings), RMSNorm (with per-head q / k norms), RoPE, bf16, random weights from a seed. The KV pool is
SGLang's layout: per layer a K and a V array ``bf16[num_pages, page_size * kv_heads * head_dim]`` (slot ``s`` is
page ``s // page_size``; page 0 holds the padding slot 0). Pages are handed to requests in a random order.

One step (``--modes``): ``off`` runs the model alone; ``none`` / ``partial`` / ``all`` run, inside one
``jax.jit``, ``canary_plan`` -> ``canary_head`` (HEAD verify + write) -> the model (which writes its KV) ->
``canary_tail`` (TAIL verify + write, real-KV source = layer 0's K array, the pool array itself: no slice, no
copy by us) and, every ``--sweep-interval`` steps, a sweep of every live request's context
(``build_sweep_plan_from_requests`` + ``canary_sweep``). The timed program is a jitted ``fori_loop`` of
``steps`` such steps that donates the KV pool and the canary state; every step passes its inputs through an
``optimization_barrier`` with the carry, so XLA cannot hoist loop-invariant work (the plan build, the weights'
layout) out of the loop. Decode feeds the sampled tokens back as the next input ids.

Scenarios (``--scenario``):

* ``decode1`` / ``decode128``: 1 / 128 requests, each with 4095 tokens in the pool, writing token 4096 (context
  4096). Attention: JAX's Pallas paged-attention kernel body
  (``jax.experimental.pallas.ops.gpu.paged_attention.paged_attention_kernel``) under a wrapper of ours whose
  block specs read SGLang's token-major pool (the stock wrapper wants a head-major pool), falling back to XLA.
* ``prefill``: 32 requests of 16384 tokens, chunked prefill of 8192 tokens per forward; the timed forward is a
  chunk with its prefix (8192 tokens after 8192 in the pool). Attention: cuDNN flash attention
  (``jax.nn.dot_product_attention(implementation='cudnn')``), one call over the prefix and one causal call over
  the chunk, merged by their log-sum-exp; XLA's implementation as the fallback. The pool holds all 32 requests
  (the sweep covers them all).
* ``write4096``: the canary write alone, 4096 requests x 1 token (decode), NONE mode, harness timing.

Timing (``benchmarks.harness`` method): wall time of the jitted loop after ``block_until_ready``, minus an empty
donating program with the same arguments, divided by the steps; the modes are interleaved, ``--rounds``
rounds, median. Then one call per mode under ``jax.profiler``: the trace's GPU kernels are summed and
attributed to parts through the compiled HLO's ``op_name`` metadata (our named scopes ``canary_plan``,
``canary_head``, ``model``, ``canary_tail``, ``canary_sweep``; inside HEAD / TAIL the library's nested
``jit(_verify_pallas)`` / ``jit(_write_pallas)`` (or the references) split verify from write; where the GPU
trace names no HLO op, by the kernel names, XLA's ``__1`` / ``__2`` suffixes and their place in the timeline: see
:func:`attribute`). ``--parts``: each
part (plan, HEAD verify, HEAD write, TAIL verify, TAIL write, sweep) also as its own jitted loop on the same
inputs, timed the same way and profiled. A flipped byte in layer 0's K between steps checks that PARTIAL / ALL
really hash the KV. Everything is printed as tables and written as JSON (``--json``, default
``$OUT/serving_step.json``).

Usage (repository root): ``python -m benchmarks.serving_step --scenario {decode1,decode128,prefill,write4096,all}
--modes off,none,partial,all --json PATH``; ``--small`` runs tiny shapes on the CPU (reference backend, XLA
attention) for the smoke test; ``--merge A.json B.json --json ALL.json`` merges per-scenario runs.

The package, by job: ``shapes`` (model shape, scenarios, targets, roofline), ``attention`` (decode / prefill
attention and their self-check), ``model`` (weights, KV pool, forward), ``batch`` (the serving batch and the
canary around it), ``programs`` (the jitted step loop and the parts' programs), ``profiles`` (trace attribution),
``timing``, ``carry`` (the donated loop state and the fault check), ``scenario`` (one scenario end to end),
``write_bench`` (the decode write microbenchmark), ``report`` (tables), ``cli`` (flags and ``main``). Every name
the single-file module had is importable from ``benchmarks.serving_step`` as before.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before jax is imported (by the modules below)

from benchmarks.serving_step.attention import (
    Attention,
    attention_label,
    attention_reference,
    choose_attention,
    decode_attention_pallas,
    decode_attention_xla,
    prefill_attention,
)
from benchmarks.serving_step.batch import (
    Shared,
    canary_batch,
    canary_config,
    make_batch,
    new_state,
    populate,
    shared_shapes,
    sources_of,
    step_ids,
)
from benchmarks.serving_step.carry import Carry, fault_check
from benchmarks.serving_step.cli import environment, main, merge, parse_args
from benchmarks.serving_step.model import allocate_pool, forward, init_params, rms_norm, rope
from benchmarks.serving_step.profiles import attribute, hlo_index, part_of, profile_call, sanitize, trace_events
from benchmarks.serving_step.programs import EMPTY, barrier, build_program, loop_of, part_args, part_programs, plan_of
from benchmarks.serving_step.report import canary_split, f, tables
from benchmarks.serving_step.scenario import run_parts, run_scenario
from benchmarks.serving_step.shapes import (
    HASH,
    HBM,
    HEAD_TAIL_TARGET_MS,
    MODES,
    PARTS,
    PEAK_BF16_FLOPS,
    QWEN3_0_6B,
    SCENARIOS,
    SMALL_MODEL,
    TARGETS,
    WRITE_TARGET_US,
    ModelShape,
    Scenario,
    bucket,
    roofline,
    scenarios,
)
from benchmarks.serving_step.timing import compile_all, log, wall
from benchmarks.serving_step.write_bench import write_bench

__all__ = [
    "Attention",
    "Carry",
    "EMPTY",
    "HASH",
    "HBM",
    "HEAD_TAIL_TARGET_MS",
    "MODES",
    "ModelShape",
    "PARTS",
    "PEAK_BF16_FLOPS",
    "QWEN3_0_6B",
    "SCENARIOS",
    "SMALL_MODEL",
    "Scenario",
    "Shared",
    "TARGETS",
    "WRITE_TARGET_US",
    "allocate_pool",
    "attention_label",
    "attention_reference",
    "attribute",
    "barrier",
    "bucket",
    "build_program",
    "canary_batch",
    "canary_config",
    "canary_split",
    "choose_attention",
    "compile_all",
    "decode_attention_pallas",
    "decode_attention_xla",
    "environment",
    "f",
    "fault_check",
    "forward",
    "hlo_index",
    "init_params",
    "log",
    "loop_of",
    "main",
    "make_batch",
    "merge",
    "new_state",
    "parse_args",
    "part_args",
    "part_of",
    "part_programs",
    "plan_of",
    "populate",
    "prefill_attention",
    "profile_call",
    "rms_norm",
    "roofline",
    "rope",
    "run_parts",
    "run_scenario",
    "sanitize",
    "scenarios",
    "shared_shapes",
    "sources_of",
    "step_ids",
    "tables",
    "trace_events",
    "wall",
    "write_bench",
]
