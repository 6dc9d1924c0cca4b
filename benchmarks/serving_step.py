#!/usr/bin/env python3
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
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import concurrent.futures
import dataclasses
import functools
import glob
import json
import math
import re
import shutil
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import canary_jax as cj
from benchmarks import harness
from canary_jax import buckets as buckets_lib
from canary_jax.constants import CanaryLaunchTag, FailReason, RealKvHashMode
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.state import CanaryBatch, CanaryState, CanaryStepConfig
from canary_jax.runtime.step import canary_head, canary_plan, canary_sweep, canary_tail
from canary_jax.runtime.sweep import build_sweep_plan_from_requests

PEAK_BF16_FLOPS = 790e12  # measured on this workplace's H200 (KINDS.md), dense bf16 on random data
HBM = harness.HBM_BYTES_PER_S  # 4.8 TB/s
MODES = ("off", "none", "partial", "all")
HASH = {"none": RealKvHashMode.NONE, "partial": RealKvHashMode.PARTIAL, "all": RealKvHashMode.ALL}
SCENARIOS = ("decode128", "prefill", "decode1")  # run order of --scenario all (the main targets first)
PARTS = ("plan", "head_verify", "head_write", "tail_verify", "tail_write", "sweep")
TARGETS = {"prefill": 9.0, "decode128": 2.5, "decode1": 5.0}  # PARTIAL over off, percent
HEAD_TAIL_TARGET_MS = {"partial": 0.3, "all": 0.6}  # decode b128
WRITE_TARGET_US = 8.0  # decode write 4096 x 1, NONE


# --- shapes --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelShape:
    """Decoder shape (Qwen3-0.6B by default; tied embeddings)."""

    layers: int = 28
    hidden: int = 1024
    q_heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 3072
    vocab: int = 151936
    rope_theta: float = 1_000_000.0
    eps: float = 1e-6

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.q_heads * self.head_dim

    @property
    def layer_matmul_params(self) -> int:
        h = self.hidden
        return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + 3 * h * self.mlp

    @property
    def params(self) -> int:
        norms = 2 * self.hidden + 2 * self.head_dim
        return self.layers * (self.layer_matmul_params + norms) + self.vocab * self.hidden + self.hidden

    @property
    def weight_bytes(self) -> int:
        return 2 * self.params


QWEN3_0_6B = ModelShape()
SMALL_MODEL = ModelShape(layers=2, hidden=64, q_heads=4, kv_heads=2, head_dim=32, mlp=128, vocab=512)


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One forward shape: ``batch`` requests, each with ``prefix`` tokens in the pool, writing ``new`` tokens;
    the pool also holds ``cached_reqs - batch`` other requests of ``cached_len`` tokens (swept, never run)."""

    name: str
    kind: str  # decode | prefill
    batch: int
    prefix: int
    new: int
    cached_reqs: int
    cached_len: int
    steps: int  # steps per timed call (a multiple of the sweep interval)
    part_launches: int  # launches per timed call of a part's own program

    @property
    def context(self) -> int:
        return self.prefix + self.new

    @property
    def tokens(self) -> int:
        return self.batch * self.new

    @property
    def verify_entries(self) -> int:
        return self.batch * self.prefix

    @property
    def sweep_entries(self) -> int:
        return self.batch * self.context + (self.cached_reqs - self.batch) * self.cached_len

    @property
    def row_len(self) -> int:
        return max(self.context, self.cached_len)


def scenarios(small: bool) -> dict[str, Scenario]:
    if small:
        return {
            "decode1": Scenario("decode1", "decode", 1, 63, 1, 1, 64, 4, 4),
            "decode128": Scenario("decode128", "decode", 8, 63, 1, 8, 64, 4, 4),
            "prefill": Scenario("prefill", "prefill", 1, 32, 32, 4, 64, 4, 4),
        }
    return {
        "decode1": Scenario("decode1", "decode", 1, 4095, 1, 1, 4096, 64, 50),
        "decode128": Scenario("decode128", "decode", 128, 4095, 1, 128, 4096, 8, 20),
        "prefill": Scenario("prefill", "prefill", 1, 8192, 8192, 32, 16384, 4, 8),
    }


def bucket(n: int) -> int:
    return max(16, 1 << max(0, int(n) - 1).bit_length())


def roofline(scn: Scenario, m: ModelShape) -> dict:
    """Decode: (weights + KV read) / HBM. Prefill: FLOPs / the bf16 peak (bytes given beside)."""
    kv_tok = 2 * m.kv_dim * 2 * m.layers  # K and V, all layers, bf16
    if scn.kind == "decode":
        kv_read = scn.batch * scn.context * kv_tok
        b = m.weight_bytes + kv_read
        return {"basis": "bytes / 4.8 TB/s", "bytes": b, "kv_read_bytes": kv_read, "ms": 1e3 * b / HBM}
    t = scn.tokens
    mm = 2 * t * m.layers * m.layer_matmul_params + 2 * m.hidden * m.vocab
    avg_keys = scn.prefix + (scn.new + 1) / 2  # causal chunk after its prefix
    att = 4 * t * avg_keys * m.q_heads * m.head_dim * m.layers
    flops = mm + att
    b = m.weight_bytes + scn.batch * scn.context * kv_tok
    return {
        "basis": "FLOPs / 790 TFLOP/s",
        "flops": flops,
        "matmul_flops": mm,
        "attention_flops": att,
        "bytes": b,
        "ms": 1e3 * flops / PEAK_BF16_FLOPS,
        "bytes_ms": 1e3 * b / HBM,
    }


# --- model ---------------------------------------------------------------------------------------------------
def init_params(m: ModelShape, seed: int) -> dict:
    """Random bf16 weights (normal / sqrt(fan_in)); norms near 1."""
    key = jax.random.PRNGKey(seed)

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def dense(k, shape, fan_in):
        return (jax.random.normal(k, shape, jnp.float32) / math.sqrt(fan_in)).astype(jnp.bfloat16)

    @functools.partial(jax.jit, static_argnums=(1,))
    def norm(k, n):
        return (1.0 + 0.1 * jax.random.normal(k, (n,), jnp.float32)).astype(jnp.bfloat16)

    h, q, kv, f = m.hidden, m.q_dim, m.kv_dim, m.mlp
    layers = []
    for i in range(m.layers):
        ks = jax.random.split(jax.random.fold_in(key, i), 11)
        layers.append(
            dict(
                ln1=norm(ks[0], h),
                wq=dense(ks[1], (h, q), h),
                wk=dense(ks[2], (h, kv), h),
                wv=dense(ks[3], (h, kv), h),
                q_norm=norm(ks[4], m.head_dim),
                k_norm=norm(ks[5], m.head_dim),
                wo=dense(ks[6], (q, h), q),
                ln2=norm(ks[7], h),
                w_gate=dense(ks[8], (h, f), h),
                w_up=dense(ks[9], (h, f), h),
                w_down=dense(ks[10], (f, h), f),
            )
        )
    ke = jax.random.split(jax.random.fold_in(key, 10_000), 2)
    return dict(embed=dense(ke[0], (m.vocab, h), 1), layers=tuple(layers), ln_f=norm(ke[1], h))


def allocate_pool(m: ModelShape, num_pages: int, page_size: int, seed: int) -> tuple[tuple, tuple]:
    """Random bf16 K and V pools, one ``[num_pages, page_size * kv_dim]`` array per layer (never zeros)."""

    @functools.partial(jax.jit, static_argnums=(1,))
    def layer(k, shape):
        return jax.random.normal(k, shape, jnp.bfloat16)

    key = jax.random.PRNGKey(seed + 1)
    shape = (num_pages, page_size * m.kv_dim)
    ks = tuple(layer(jax.random.fold_in(key, 2 * i), shape) for i in range(m.layers))
    vs = tuple(layer(jax.random.fold_in(key, 2 * i + 1), shape) for i in range(m.layers))
    return ks, vs


def rms_norm(x, w, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(jnp.bfloat16)


def rope(x, positions, theta):
    """Rotate-half RoPE of ``x [T, H, D]`` at ``positions [T]``."""
    half = x.shape[-1] // 2
    inv = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    ang = positions.astype(jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def decode_attention_xla(q, k_pages, v_pages, block_tables, lengths):
    """``q [B, Hq, D]`` (pre-scaled) over token-major pages ``[P, ps, Hk, D]``: gather + einsum (XLA)."""
    b, hq, d = q.shape
    _, ps, hk, _ = k_pages.shape
    n = block_tables.shape[1] * ps
    kc = k_pages[block_tables].reshape(b, n, hk, d)
    vc = v_pages[block_tables].reshape(b, n, hk, d)
    s = jnp.einsum("bhgd,bshd->bhgs", q.reshape(b, hk, hq // hk, d), kc, preferred_element_type=jnp.float32)
    s = jnp.where((jnp.arange(n)[None, :] < lengths[:, None])[:, None, None, :], s, -1e30)
    p = jax.nn.softmax(s, axis=-1).astype(vc.dtype)
    o = jnp.einsum("bhgs,bshd->bhgd", p, vc, preferred_element_type=jnp.float32)
    return o.reshape(b, hq, d).astype(q.dtype)


def _kv_splits(pages_per_seq: int) -> tuple[int, int]:
    k_splits = next(k for k in (16, 8, 4, 2, 1) if pages_per_seq % k == 0)
    return k_splits, max(1, min(8, pages_per_seq // k_splits))


def decode_attention_pallas(q, k_pages, v_pages, block_tables, lengths, *, interpret=None):
    """JAX's Pallas GPU paged-attention kernel body over SGLang's token-major pool.

    ``jax.experimental.pallas.ops.gpu.paged_attention.paged_attention`` wants ``[Hk, pages, page_size, D]``;
    this wrapper is its ``paged_attention_unbatched`` with the K / V block specs reading head ``h`` of
    ``[pages, page_size, Hk, D]`` instead (the kernel body is JAX's, unchanged). ``q`` is pre-scaled.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    from jax.experimental.pallas.ops.gpu import paged_attention as pa

    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    b, hq, d = q.shape
    num_pages, ps, hk, _ = k_pages.shape
    pps = block_tables.shape[1]
    k_splits, ppcb = _kv_splits(pps)
    ppp = pps // k_splits
    g = hq // hk
    block_h = 16
    head_splits = -(-g // block_h)
    kernel = functools.partial(
        pa.paged_attention_kernel,
        num_heads=g,
        pages_per_compute_block=ppcb,
        mask_value=pa.DEFAULT_MASK_VALUE,
        attn_logits_soft_cap=None,
    )

    def one(q1, bt, ln):  # q1 [Hq, D], bt [pps], ln [1]
        qr = q1.reshape(hk, g, d)
        if g % block_h:
            qr = jnp.pad(qr, ((0, 0), (0, -g % block_h), (0, 0)))
        o, l_, m_ = pl.pallas_call(
            kernel,
            grid=(hk, head_splits, k_splits),
            in_specs=[
                pl.BlockSpec((None, block_h, d), lambda h, i, k: (h, i, 0)),
                pl.BlockSpec((num_pages, ps, None, d), lambda h, i, k: (0, 0, h, 0)),
                None,
                pl.BlockSpec((num_pages, ps, None, d), lambda h, i, k: (0, 0, h, 0)),
                None,
                pl.BlockSpec((None, ppp), lambda h, i, k: (k, 0)),
                pl.BlockSpec((1,), lambda h, i, k: (0,)),
            ],
            out_specs=[
                pl.BlockSpec((None, None, block_h, d), lambda h, i, k: (k, h, i, 0)),
                pl.BlockSpec((None, None, block_h), lambda h, i, k: (k, h, i)),
                pl.BlockSpec((None, None, block_h), lambda h, i, k: (k, h, i)),
            ],
            out_shape=[
                jax.ShapeDtypeStruct((k_splits, *qr.shape), q.dtype),
                jax.ShapeDtypeStruct((k_splits, *qr.shape[:-1]), jnp.float32),
                jax.ShapeDtypeStruct((k_splits, *qr.shape[:-1]), jnp.float32),
            ],
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
            name="paged_attention_token_major",
        )(qr, k_pages, None, v_pages, None, bt.reshape(k_splits, ppp), ln)
        o, l_, m_ = o[..., :g, :], l_[..., :g], m_[..., :g]
        m_next = m_.max(axis=0)
        corr = jnp.exp(m_ - m_next[None])
        o = o.astype(jnp.float32) * corr[..., None]
        l_next = (l_ * corr).sum(axis=0)
        o = o.sum(axis=0) / (l_next[..., None] + jnp.finfo(jnp.float32).eps)
        return o.reshape(hq, d).astype(q.dtype)

    return jax.vmap(one)(q, block_tables, lengths[:, None].astype(jnp.int32))


def prefill_attention(q, k_prefix, v_prefix, k_new, v_new, *, impl):
    """A chunk after its prefix: ``dot_product_attention`` over the prefix (no mask) and over the chunk
    (causal, square), merged by the two log-sum-exps. ``q [T, Hq, D]``, keys ``[S, Hk, D]``."""
    dpa = functools.partial(jax.nn.dot_product_attention, implementation=impl, return_residual=True)
    o1, l1 = dpa(q[None], k_prefix[None], v_prefix[None], is_causal=False)
    o2, l2 = dpa(q[None], k_new[None], v_new[None], is_causal=True)
    l1, l2 = l1.astype(jnp.float32), l2.astype(jnp.float32)
    mx = jnp.maximum(l1, l2)
    w1, w2 = jnp.exp(l1 - mx)[..., None], jnp.exp(l2 - mx)[..., None]
    o = (o1.astype(jnp.float32) * w1 + o2.astype(jnp.float32) * w2) / (w1 + w2)
    return o[0].astype(q.dtype)


def attention_reference(q, k, v, q_pos, k_len):
    """f32 reference: query ``t`` at position ``q_pos[t]`` sees keys ``[0, min(q_pos[t] + 1, k_len))``."""
    hq, hk = q.shape[1], k.shape[1]
    kk = jnp.repeat(k.astype(jnp.float32), hq // hk, axis=1)
    vv = jnp.repeat(v.astype(jnp.float32), hq // hk, axis=1)
    s = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), kk) / math.sqrt(q.shape[-1])
    keys = jnp.arange(k.shape[0])
    ok = (keys[None, :] <= q_pos[:, None]) & (keys[None, :] < k_len)
    s = jnp.where(ok[None], s, -1e30)
    return jnp.einsum("hts,shd->thd", jax.nn.softmax(s, axis=-1), vv)


@dataclasses.dataclass(frozen=True)
class Attention:
    decode: str  # pallas | xla
    prefill: str  # cudnn | xla


def forward(params, kv, ids, positions, loc, b, *, m: ModelShape, kind: str, attn: Attention, page_size: int):
    """One forward: writes K / V of the ``T`` tokens at ``loc``, attends, samples (greedy) the last token of each
    request. Returns ``(kv, next_tokens int32[B])``."""
    ks, vs = list(kv[0]), list(kv[1])
    t = ids.shape[0]
    x = params["embed"][ids]
    scale = 1.0 / math.sqrt(m.head_dim)
    for li, lp in enumerate(params["layers"]):
        h = rms_norm(x, lp["ln1"], m.eps)
        q = (h @ lp["wq"]).reshape(t, m.q_heads, m.head_dim)
        k = (h @ lp["wk"]).reshape(t, m.kv_heads, m.head_dim)
        v = (h @ lp["wv"]).reshape(t, m.kv_heads, m.head_dim)
        q = rope(rms_norm(q, lp["q_norm"], m.eps), positions, m.rope_theta)
        k = rope(rms_norm(k, lp["k_norm"], m.eps), positions, m.rope_theta)
        pages = ks[li].shape[0]
        shape4 = (pages, page_size, m.kv_heads, m.head_dim)
        kf = ks[li].reshape(pages * page_size, m.kv_heads, m.head_dim).at[loc].set(k, unique_indices=True)
        vf = vs[li].reshape(pages * page_size, m.kv_heads, m.head_dim).at[loc].set(v, unique_indices=True)
        ks[li], vs[li] = kf.reshape(ks[li].shape), vf.reshape(vs[li].shape)
        if kind == "decode":
            fn = decode_attention_pallas if attn.decode == "pallas" else decode_attention_xla
            qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
            o = fn(qs, kf.reshape(shape4), vf.reshape(shape4), b["bt"], b["lengths"])
        else:
            o = prefill_attention(q, kf[b["pslots"]], vf[b["pslots"]], k, v, impl=attn.prefill)
        x = x + o.reshape(t, m.q_dim) @ lp["wo"]
        h = rms_norm(x, lp["ln2"], m.eps)
        x = x + (jax.nn.silu(h @ lp["w_gate"]) * (h @ lp["w_up"])) @ lp["w_down"]
    xs = rms_norm(x[b["sample"]], params["ln_f"], m.eps)
    logits = xs @ params["embed"].T  # bf16 out (f32 accumulation): no f32 copy of the embedding
    return (tuple(ks), tuple(vs)), jnp.argmax(logits, axis=-1).astype(jnp.int32)


# --- the serving batch, the canary --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shared:
    """Shapes every scenario shares: the pool's pages (the largest scenario's requests plus page 0), the
    ``req_to_token`` table and the population's padded launch, so that the population programs compile once
    per mode for all scenarios."""

    num_pages: int
    r2t_rows: int
    r2t_cols: int
    pop_tokens: int
    pop_rows: int


def shared_shapes(scn_all: dict[str, Scenario], page_size: int) -> Shared:
    return Shared(
        num_pages=1 + max(s.cached_reqs * (s.row_len // page_size) for s in scn_all.values()),
        r2t_rows=1 + max(s.cached_reqs for s in scn_all.values()),
        r2t_cols=max(s.row_len for s in scn_all.values()),
        pop_tokens=bucket(max(s.verify_entries + (s.cached_reqs - s.batch) * s.cached_len for s in scn_all.values())),
        pop_rows=max(s.cached_reqs for s in scn_all.values()),
    )


def make_batch(scn: Scenario, m: ModelShape, sh: Shared, page_size: int, seed: int) -> tuple[dict, dict]:
    """Device inputs of the step (``b``) and the host data of the population (``pop``)."""
    rng = np.random.default_rng(seed + sum(map(ord, scn.name)))
    ppr = scn.row_len // page_size
    perm = rng.permutation(np.arange(1, sh.num_pages))[: scn.cached_reqs * ppr].reshape(scn.cached_reqs, ppr)
    r2t = np.zeros((sh.r2t_rows, sh.r2t_cols), np.int32)
    for r in range(scn.cached_reqs):
        r2t[r + 1, : scn.row_len] = (perm[r][:, None] * page_size + np.arange(page_size)[None, :]).reshape(-1)
    rows = np.arange(1, scn.batch + 1)
    b = dict(
        rpi=rows.astype(np.int32),
        prefix=np.full(scn.batch, scn.prefix, np.int32),
        extend=np.full(scn.batch, scn.new, np.int32),
        positions=np.tile(np.arange(scn.prefix, scn.context, dtype=np.int32), scn.batch),
        loc=r2t[rows][:, scn.prefix : scn.context].reshape(-1).astype(np.int32),
        r2t=r2t,
        sweep_rpi=np.arange(1, scn.cached_reqs + 1, dtype=np.int32),
        sweep_lens=np.array([scn.context] * scn.batch + [scn.cached_len] * (scn.cached_reqs - scn.batch), np.int32),
    )
    if scn.kind == "decode":
        b["bt"] = perm[: scn.batch, : scn.context // page_size].astype(np.int32)
        b["lengths"] = np.full(scn.batch, scn.context, np.int32)
        b["sample"] = np.arange(scn.batch, dtype=np.int32)
        b["ids"] = np.zeros(scn.tokens, np.int32)  # decode feeds back its sampled tokens
    else:
        b["pslots"] = r2t[1, : scn.prefix].astype(np.int32)
        b["sample"] = np.array([scn.tokens - 1], np.int32)
        b["ids"] = rng.integers(0, m.vocab, scn.tokens).astype(np.int32)
    lens = [scn.prefix] * scn.batch + [scn.cached_len] * (scn.cached_reqs - scn.batch)
    pop = dict(
        rpi=np.arange(1, scn.cached_reqs + 1),
        lens=np.array(lens),
        ids=rng.integers(0, m.vocab, int(sum(lens))),
        positions=np.concatenate([np.arange(n) for n in lens]),
        loc=np.concatenate([r2t[r + 1, :n] for r, n in enumerate(lens)]),
        r2t=r2t,
        toks=rng.integers(0, m.vocab, scn.batch if scn.kind == "decode" else 1).astype(np.int32),
    )
    return {k: jnp.asarray(v) for k, v in b.items()}, pop


def canary_config(scn: Scenario, mode: str, backend: str | None) -> CanaryStepConfig:
    return CanaryStepConfig(
        verify_capacity=bucket(scn.verify_entries),
        write_req_capacity=scn.batch,
        real_kv_hash_mode=HASH[mode],
        backend=backend,
    )


def new_state(num_slots: int) -> CanaryState:
    group = CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=num_slots, has_v_half=False)
    return CanaryState.create([group], ring_capacity=1024)


def sources_of(kv, m: ModelShape, page_size: int, read_bytes: int):
    """Layer 0's K array, as it is (2-D, one page per row): the group's K-half source."""
    src = cj.RealKvSource(tensor=kv[0][0], page_size=page_size, num_bytes_per_token=2 * m.kv_dim, read_bytes=read_bytes)
    return (((src,), ()),)


def canary_batch(b: dict, ids) -> CanaryBatch:
    return CanaryBatch(
        req_pool_indices=b["rpi"],
        prefix_lens=b["prefix"],
        extend_seq_lens=b["extend"],
        input_ids=ids,
        positions=b["positions"],
        out_cache_loc=b["loc"],
        req_to_token=b["r2t"],
    )


def step_ids(scn: Scenario, m: ModelShape, b: dict, toks):
    return toks if scn.kind == "decode" else (b["ids"] + toks[0]) % m.vocab


def populate(state: CanaryState, mode: str, pop: dict, kv, m, page_size, read_bytes, sh: Shared) -> CanaryState:
    """Stamps the pool's prefixes (HEAD and TAIL, with the real KV now in the pool) with the reference backend
    (byte-identical to the kernels; XLA only, so no Triton compiles)."""
    cfg = CanaryStepConfig(
        verify_capacity=16,
        write_req_capacity=sh.pop_rows,
        real_kv_hash_mode=HASH[mode],
        backend="reference",
        buckets=buckets_lib.Buckets(sizes=(sh.pop_tokens,)),
    )
    # Plans and HEAD do not depend on the hash mode: one NONE config for them compiles them once per scenario.
    cfg_head = dataclasses.replace(cfg, real_kv_hash_mode=RealKvHashMode.NONE)
    n = len(pop["lens"])
    batch = CanaryBatch(
        req_pool_indices=pop["rpi"],
        prefix_lens=np.zeros(n, np.int64),
        extend_seq_lens=pop["lens"],
        input_ids=pop["ids"],
        positions=pop["positions"],
        out_cache_loc=pop["loc"],
        req_to_token=pop["r2t"],
    )
    plans = canary_plan(state, batch, config=cfg_head)
    state, plans = canary_head(state, batch, config=cfg_head, plans=plans)
    state, _ = canary_tail(state, plans, batch, config=cfg, real_kv_sources=sources_of(kv, m, page_size, read_bytes))
    return state


def barrier(consts, carry):
    """Ties the loop-invariant inputs to a loop-carried value (an ``optimization_barrier``), so XLA cannot hoist
    work on them (the plan build, the weights' layout) out of the timed loop; the carry itself stays outside
    the barrier (it is loop-variant already, and its big buffers keep their aliasing)."""
    leaves, tree = jax.tree.flatten(carry)
    tie = min(range(len(leaves)), key=lambda i: leaves[i].size)  # the smallest carried array
    consts, leaves[tie] = jax.lax.optimization_barrier((consts, leaves[tie]))
    return consts, jax.tree.unflatten(tree, leaves)


def build_program(scn, mode, m, attn, args, sweep_interval):
    """The timed program: ``steps`` serving steps (and a sweep every ``sweep_interval``) in one jit, carry
    ``(kv, state, toks, summary)`` donated."""
    cfg = None if mode == "off" else canary_config(scn, mode, args.backend)
    interval = sweep_interval if sweep_interval > 0 else scn.steps
    cycles = scn.steps // interval
    ps, rb = args.page_size, args.read_bytes or 2 * m.kv_dim
    fwd = functools.partial(forward, m=m, kind=scn.kind, attn=attn, page_size=ps)

    def one_step(carry, consts):
        consts, carry = barrier(consts, carry)
        params, b = consts
        kv, state, toks, summ = carry
        ids = step_ids(scn, m, b, toks)
        if cfg is not None:
            cb = canary_batch(b, ids)
            with jax.named_scope("canary_plan"):
                plans = canary_plan(state, cb, config=cfg)
            with jax.named_scope("canary_head"):
                state, plans = canary_head(state, cb, config=cfg, plans=plans)
        with jax.named_scope("model"):
            kv, toks = fwd(params, kv, ids, b["positions"], b["loc"], b)
        if cfg is not None:
            with jax.named_scope("canary_tail"):
                state, s = canary_tail(state, plans, cb, config=cfg, real_kv_sources=sources_of(kv, m, ps, rb))
            summ = (s.verify_enable, s.verify_num_valid)
        return kv, state, toks, summ

    def cycle(carry, consts):
        carry = jax.lax.fori_loop(0, interval, lambda i, c: one_step(c, consts), carry)
        if cfg is not None and sweep_interval > 0:
            consts, carry = barrier(consts, carry)
            _, b = consts
            kv, state, toks, summ = carry
            with jax.named_scope("canary_sweep"):
                plan = build_sweep_plan_from_requests(
                    req_to_token=b["r2t"],
                    req_pool_indices=b["sweep_rpi"],
                    seq_lens=b["sweep_lens"],
                    verify_capacity=bucket(scn.sweep_entries),
                )
                state = canary_sweep(state, (plan,), config=cfg, real_kv_sources=sources_of(kv, m, ps, rb))
            carry = (kv, state, toks, summ)
        return carry

    def program(carry, consts):
        return jax.lax.fori_loop(0, cycles, lambda i, c: cycle(c, consts), carry)

    return jax.jit(program, donate_argnums=(0,))


def _empty(carry, consts):
    return carry


EMPTY = jax.jit(_empty, donate_argnums=(0,))


# --- the parts as their own programs --------------------------------------------------------------------------
def part_programs(scn, m, args, modes):
    """``{name: (fn(carry, consts) -> carry, mode)}``: each part of the step on the step's inputs."""
    ps, rb = args.page_size, args.read_bytes or 2 * m.kv_dim
    canary_modes = [x for x in modes if x != "off"]
    if not canary_modes:
        return {}
    head_mode = canary_modes[0]
    cfg = {x: canary_config(scn, x, args.backend) for x in canary_modes}
    backend = args.backend

    def ctx(buf, tag, log, srcs, mode):
        return cj.VerifyOrWriteContext(
            canary_buf=buf, kernel_kind=tag, log=log, real_kv_sources=srcs, real_kv_hash_mode=HASH[mode]
        )

    def plan_fn(carry, consts):
        consts, carry = barrier(consts, carry)
        state, b, toks = consts
        return canary_plan(state, canary_batch(b, step_ids(scn, m, b, toks)), config=cfg[head_mode])

    def verify_fn(tag, mode, with_src):
        def fn(log, consts):
            consts, log = barrier(consts, log)
            buf, plans, kv0 = consts
            srcs = sources_of(((kv0,), ()), m, ps, rb)[0][0] if with_src else ()
            vp = plans.per_group[0][0]
            return cj.verify(ctx(buf, tag, log, srcs, mode), vp, backend=backend).log

        return fn

    def write_fn(tag, mode, with_src):
        def fn(carry, consts):
            consts, carry = barrier(consts, carry)
            buf, log = carry
            plans, b, toks, kv0 = consts
            cb = canary_batch(b, step_ids(scn, m, b, toks))
            srcs = sources_of(((kv0,), ()), m, ps, rb)[0][0] if with_src else ()
            out = cj.write(
                ctx(buf, tag, log, srcs, mode),
                plans.per_group[0][1],
                cb.input_ids,
                cb.positions,
                cb.out_cache_loc,
                backend=backend,
            )
            return out.canary_buf, out.log

        return fn

    def sweep_fn(mode):
        def fn(state, consts):
            consts, state = barrier(consts, state)
            b, kv0 = consts
            plan = build_sweep_plan_from_requests(
                req_to_token=b["r2t"],
                req_pool_indices=b["sweep_rpi"],
                seq_lens=b["sweep_lens"],
                verify_capacity=bucket(scn.sweep_entries),
            )
            return canary_sweep(state, (plan,), config=cfg[mode], real_kv_sources=sources_of(((kv0,), ()), m, ps, rb))

        return fn

    out = {
        "plan": (plan_fn, head_mode),
        "head_verify": (verify_fn(CanaryLaunchTag.HEAD_K_FULL, head_mode, False), head_mode),
        "head_write": (write_fn(CanaryLaunchTag.HEAD_K_FULL, head_mode, False), head_mode),
    }
    for x in canary_modes:
        out[f"tail_verify:{x}"] = (verify_fn(CanaryLaunchTag.TAIL_K_FULL, x, x != "none"), x)
        out[f"tail_write:{x}"] = (write_fn(CanaryLaunchTag.TAIL_K_FULL, x, x != "none"), x)
        if args.sweep_interval > 0:
            out[f"sweep:{x}"] = (sweep_fn(x), x)
    return out


def part_args(name, state, plans, b, toks, kv):
    """(carry, consts) of a part's program: copies of the state's buffers, so the step's state is untouched."""
    g = state.groups[0]
    cp = functools.partial(jax.tree.map, lambda a: jnp.copy(a) if isinstance(a, jax.Array) else a)
    kv0 = kv[0][0]
    kind = name.split(":")[0]
    if kind == "plan":
        return cp(plans), (state, b, toks)
    if kind == "head_verify":
        return cp(state.log), (g.k_head, plans, kv0)
    if kind == "head_write":
        return (cp(g.k_head), cp(state.log)), (plans, b, toks, kv0)
    if kind == "tail_verify":
        return cp(state.log), (g.k_tail, plans, kv0)
    if kind == "tail_write":
        return (cp(g.k_tail), cp(state.log)), (plans, b, toks, kv0)
    return cp(state), (b, kv0)


def loop_of(fn, n):
    def many(carry, consts):
        return jax.lax.fori_loop(0, n, lambda i, c: fn(c, consts), carry)

    return jax.jit(many, donate_argnums=(0,))


# --- profiles ------------------------------------------------------------------------------------------------
_DERIVED_LINES = {"XLA Modules", "XLA Ops", "TensorFlow Ops", "TensorFlow Name Scope", "Steps", "Source code"}


def hlo_index(hlo_text: str) -> tuple[str, dict]:
    """``(module name, {instruction name: (opcode, op_name)})`` of an optimized HLO module's text."""
    module = ""
    out = {}
    for line in hlo_text.splitlines():
        if line.startswith("HloModule "):
            module = line.split()[1].rstrip(",")
            continue
        mt = re.match(r"\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$", line)
        if not mt:
            continue
        name, rest = mt.group(1), mt.group(2)
        op = re.search(r"(?:^|[\s)}\]])([a-z][a-z0-9\-]*)\(", rest)
        meta = re.search(r'op_name="([^"]*)"', rest)
        out[name] = (op.group(1) if op else "", meta.group(1) if meta else "")
    return module, out


def sanitize(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def part_of(op_name: str, kernel: str) -> str:
    """The step part an HLO op belongs to, from its op_name (named scopes, nested jits) or its kernel name."""
    s = op_name or ""
    low = kernel.lower()
    if "canary_sweep" in s:
        return "sweep_plan" if "build_plans" in s else "sweep_verify"
    if "canary_plan" in s:
        return "plan"
    for phase in ("head", "tail"):
        if f"canary_{phase}" in s:
            if "verify" in s:
                return f"{phase}_verify"
            if "write" in s:
                return f"{phase}_write"
            return f"{phase}_other"
    if "/model/" in s or s.endswith("/model"):
        return "model"
    if "build_plans" in s:
        return "plan"
    if "verify" in s:
        return "verify"
    if "write" in s:
        return "write"
    if low.startswith("canary_"):
        return "canary_unattributed"
    if any(x in low for x in ("gemm", "xmma", "cutlass", "nvjet", "cudnn", "flash", "paged_attention", "sm90")):
        return "model"
    if low.startswith("memcpy") or low.startswith("memset"):
        return "memcpy"
    return "other"


def trace_events(logdir: str, module: str) -> tuple[list, dict]:
    """Kernel events ``(name, start ns, duration ns, hlo_op, tf_op)`` of the newest trace under ``logdir``, in
    start order (GPU streams; on the CPU the thunks of ``module``), and what was seen (planes, lines)."""
    files = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        return [], {"error": "no xplane file"}
    pd = jax.profiler.ProfileData.from_file(files[-1])
    planes = list(pd.planes)
    seen = {"planes": [p.name for p in planes]}
    events = []
    gpu = [p for p in planes if p.name.startswith("/device:GPU")]
    if gpu:
        lines_seen, stat_names = [], set()
        for p in gpu:
            lines = list(p.lines)
            lines_seen += [ln.name for ln in lines]
            stream = [ln for ln in lines if ln.name.startswith("Stream")]
            use = stream or [ln for ln in lines if ln.name not in _DERIVED_LINES]
            for ln in use:
                for e in ln.events:
                    st = dict(e.stats)
                    stat_names.update(st)
                    events.append((e.name, float(e.start_ns), float(e.duration_ns), st.get("hlo_op"), st.get("tf_op")))
        seen["gpu_lines"] = sorted(set(lines_seen))
        seen["stat_names"] = sorted(stat_names)
        n = max(1, len(events))
        seen["events_with_hlo_op"] = sum(1 for e in events if e[3]) / n
        seen["events_with_tf_op"] = sum(1 for e in events if e[4]) / n
    else:
        for p in planes:
            if not p.name.startswith("/host:CPU"):
                continue
            for ln in p.lines:
                for e in ln.events:
                    st = dict(e.stats)
                    if st.get("hlo_module") == module and st.get("hlo_op"):
                        events.append((e.name, float(e.start_ns), float(e.duration_ns), st.get("hlo_op")))
    events.sort(key=lambda e: e[1])
    return events, seen


_CANARY_KERNEL = re.compile(r"^(canary_[a-z_]+?)(?:__(\d+))?$")
_SHARED = ("canary_write_won", "canary_write_long")  # one kernel serves HEAD and TAIL (deduplicated by XLA)


def _canary_phase(name: str, region: str | None) -> tuple[str, str] | None:
    """``(phase, kind)`` of a Pallas canary kernel without an op_name. XLA names identical kernels once and the
    others ``__1``, ``__2`` in program order, and the step's order is HEAD, TAIL, sweep: so index 0 is HEAD,
    1 TAIL, 2 the sweep; a kernel HEAD and TAIL share (``_SHARED``), and a TAIL kernel the sweep reuses (same
    shapes), take the phase of where they run in the timeline (``region``)."""
    mt = _CANARY_KERNEL.match(name)
    if not mt:
        return None
    base, idx = mt.group(1), int(mt.group(2) or 0)
    kind = "verify" if "verify" in base else "write"
    if base in _SHARED or region == "sweep":
        phase = {"plan": "head", "model": "tail"}.get(region, region) or ("head" if idx == 0 else "tail")
    else:
        phase = ("head", "tail", "sweep")[min(idx, 2)]
    return phase, kind


def attribute(events: list, hlo: dict, steps: float, top: int = 25, cycle: int = 0) -> dict:
    """Kernel time per step by part, the top kernels, and how much had no op_name.

    A kernel's part comes from its HLO op_name (through the ``hlo_op`` stat or its sanitized kernel name); a
    Pallas canary kernel without one by :func:`_canary_phase`; a copy or other unattributed kernel that runs
    inside the canary's part of the timeline (after the plan, or after a canary kernel that follows the model)
    is charged to that part as ``<part>_copy`` / ``<part>_other``. When the sweep's plan has the per-forward
    plan's shapes, XLA gives both the same kernels (names): a verify kernel of index >= 1 that follows plan
    kernels with no model kernel between is then the sweep's, and so are those plan kernels.
    ``cycle`` > 0 keeps the non-model kernels of the last ``cycle`` steps' worth of events as ``timeline``.
    """
    by_sanitized = {sanitize(k): k for k in hlo}
    labels: list = []  # (name, ns, part) per kept event
    unattributed = 0.0
    region, plan_start = None, 0  # plan | head | model | tail | sweep; where the current plan region began
    for name, _, ns, hlo_op, *rest in events:
        key = hlo_op if hlo_op in hlo else by_sanitized.get(sanitize(name))
        opcode, op_name = hlo.get(key, ("", "")) if key else ("", "")
        op_name = op_name or (rest[0] if rest and isinstance(rest[0], str) else "")  # the trace's tf_op stat
        if opcode in ("while", "conditional", "call", "async-start", "async-done", "tuple", "parameter"):
            continue  # CPU control-flow thunks (their bodies are counted themselves)
        part = part_of(op_name, name)
        if not op_name:
            unattributed += ns
            mt = _CANARY_KERNEL.match(name)
            if mt and region == "plan" and "verify" in name and int(mt.group(2) or 0) >= 1:
                for i in range(plan_start, len(labels)):  # the plan kernels since the TAIL were the sweep's
                    n_, ns_, p_ = labels[i]
                    if p_ == "plan" or p_.startswith("plan_"):
                        labels[i] = (n_, ns_, p_.replace("plan", "sweep_plan", 1) if p_ == "plan" else "sweep" + p_[4:])
                region = "sweep"
            cp = _canary_phase(name, region)
            if cp is not None:
                part = f"{cp[0]}_{cp[1]}"
            elif part in ("other", "memcpy") and region in ("plan", "head", "tail", "sweep"):
                part = f"{region}_{'copy' if part == 'memcpy' else 'other'}"
        if part == "plan":
            if region != "plan":
                plan_start = len(labels)
            region = "plan"
        elif part == "sweep_plan":
            region = "sweep"
        elif part == "model":
            region = "model"
        elif part.startswith(("head_", "tail_", "sweep_")) and not part.endswith(("_copy", "_other")):
            region = part.split("_")[0]
        labels.append((name, ns, part))
    parts: dict[str, float] = {}
    kernels: dict[tuple, list] = {}
    total = 0.0
    for name, ns, part in labels:
        total += ns
        parts[part] = parts.get(part, 0.0) + ns
        k = kernels.setdefault((name, part), [0.0, 0])
        k[0] += ns
        k[1] += 1
    per = 1e6 * steps  # ns -> ms per step
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    out = {
        "kernel_sum_ms": total / per,
        "parts_ms": {k: v / per for k, v in sorted(parts.items())},
        "no_op_name_frac": unattributed / total if total else None,
        "events": len(events),
        "launches_per_step": {p: sum(v[1] for (_, q), v in kernels.items() if q == p) / steps for p in parts},
        "top_kernels": [
            {"kernel": n[:120], "part": p, "ms_per_step": v[0] / per, "launches_per_step": v[1] / steps}
            for (n, p), v in rows[:top]
        ],
        "canary_kernels": [
            {"kernel": n[:120], "part": p, "ms_per_step": v[0] / per, "launches_per_step": v[1] / steps}
            for (n, p), v in rows
            if p not in ("model",)
        ][:80],
    }
    if cycle > 0 and steps > 0:
        tail = labels[-int(len(labels) * min(1.0, cycle / steps)) :]
        out["timeline"] = [[n[:60], p, round(ns / 1e3, 2)] for n, ns, p in tail if p != "model"]
    return out


def profile_call(fn, logdir: str, module: str, hlo: dict, steps: float, cycle: int = 0):
    """Runs ``fn()`` under the profiler; returns ``(result, attribution)``."""
    shutil.rmtree(logdir, ignore_errors=True)
    os.makedirs(logdir, exist_ok=True)
    jax.profiler.start_trace(logdir)
    try:
        out = jax.block_until_ready(fn())
    finally:
        jax.profiler.stop_trace()
    events, seen = trace_events(logdir, module)
    res = attribute(events, hlo, steps, cycle=cycle) if events else {}
    res["trace"] = seen
    return out, res


# --- timing helpers ------------------------------------------------------------------------------------------
def wall(fn, *a):
    t = time.perf_counter()
    out = jax.block_until_ready(fn(*a))
    return time.perf_counter() - t, out


def _compile_one(lowered):
    t = time.perf_counter()
    try:
        return lowered.compile(), time.perf_counter() - t
    except Exception as e:  # noqa: BLE001 - reported per program
        traceback.print_exc()
        return e, time.perf_counter() - t


def compile_all(jobs: dict, workers: int) -> dict:
    """``{key: lowered}`` compiled concurrently (XLA / Triton compile outside the GIL): ``{key: (compiled or
    exception, seconds)}``."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as ex:
        futs = {k: ex.submit(_compile_one, v) for k, v in jobs.items()}
        return {k: f.result() for k, f in futs.items()}


def log(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)


# --- attention self-checks -------------------------------------------------------------------------------------
def choose_attention(args, on_gpu: bool, t0: float) -> tuple[Attention, dict]:
    """Picks the decode / prefill attention: the requested one, or on the GPU the fastest one that compiles and
    matches an f32 reference on small inputs (XLA otherwise)."""
    info = {}
    dec = args.attn_decode if args.attn_decode != "auto" else ("pallas" if on_gpu else "xla")
    pre = args.attn_prefill if args.attn_prefill != "auto" else ("cudnn" if on_gpu else "xla")
    rng = np.random.default_rng(7)
    if dec == "pallas":
        try:
            ps, hk, hq, d, pages, b = 16, 2, 4, 128, 40, 2
            kp = jnp.asarray(rng.standard_normal((pages, ps, hk, d)), jnp.bfloat16)
            vp = jnp.asarray(rng.standard_normal((pages, ps, hk, d)), jnp.bfloat16)
            q = jnp.asarray(rng.standard_normal((b, hq, d)) / math.sqrt(d), jnp.bfloat16)
            bt = jnp.asarray(rng.permutation(np.arange(1, pages))[: b * 16].reshape(b, 16), jnp.int32)
            lengths = jnp.asarray([256, 200], jnp.int32)
            got = jax.jit(functools.partial(decode_attention_pallas, interpret=not on_gpu))(q, kp, vp, bt, lengths)
            want = jax.jit(decode_attention_xla)(q, kp, vp, bt, lengths)
            err = float(jnp.linalg.norm((got - want).astype(jnp.float32)) / jnp.linalg.norm(want.astype(jnp.float32)))
            info["decode_check_rel_err"] = err
            if not err < 2e-2:
                raise ValueError(f"relative error {err:.3g} against XLA")
        except Exception as e:  # noqa: BLE001
            info["decode_fallback"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
            dec = "xla"
    if pre == "cudnn":
        try:
            s, t, hq, hk, d = 256, 128, 4, 2, 128
            q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.bfloat16)
            kk = jnp.asarray(rng.standard_normal((s + t, hk, d)), jnp.bfloat16)
            vv = jnp.asarray(rng.standard_normal((s + t, hk, d)), jnp.bfloat16)
            fn = jax.jit(functools.partial(prefill_attention, impl="cudnn"))
            got = fn(q, kk[:s], vv[:s], kk[s:], vv[s:])
            want = attention_reference(q, kk, vv, jnp.arange(s, s + t), s + t)
            err = float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))
            info["prefill_check_rel_err"] = err
            if not err < 3e-2:
                raise ValueError(f"relative error {err:.3g} against the f32 reference")
        except Exception as e:  # noqa: BLE001
            info["prefill_fallback"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
            pre = "xla"
    log(f"attention: decode={dec} prefill={pre} {info}", t0)
    return Attention(decode=dec, prefill=pre), info


def attention_label(attn: Attention, kind: str) -> str:
    if kind == "decode":
        return (
            "Pallas paged_attention_kernel (jax.experimental.pallas.ops.gpu.paged_attention), token-major wrapper"
            if attn.decode == "pallas"
            else "XLA (page gather + einsum)"
        )
    return (
        "cuDNN flash attention (jax.nn.dot_product_attention implementation='cudnn'), prefix + causal chunk, LSE merge"
        if attn.prefill == "cudnn"
        else "XLA jax.nn.dot_product_attention, prefix + causal chunk, LSE merge"
    )


# --- one scenario --------------------------------------------------------------------------------------------
class Carry:
    """The donated loop state of every mode: one shared KV pool, a canary state, sampled tokens and the last
    step summary per mode. A call hands the pool from mode to mode (the modes write the same slots)."""

    def __init__(self, kv, states, toks, summ):
        self.kv, self.states, self.toks, self.summ = kv, states, toks, summ

    def of(self, x):
        return (self.kv, self.states.get(x), self.toks[x], self.summ[x])

    def call(self, fn, x, consts) -> float:
        dt, out = wall(fn, self.of(x), consts)
        self.kv, st, self.toks[x], self.summ[x] = out
        if st is not None:
            self.states[x] = st
        return dt

    def flip(self, row, col) -> None:
        ks = list(self.kv[0])
        ks[0] = _flip(ks[0], row, col)
        self.kv = (tuple(ks), self.kv[1])


@functools.partial(jax.jit, donate_argnums=(0,))
def _flip(arr, row, col):
    x = jax.lax.bitcast_convert_type(arr[row, col], jnp.uint16) ^ jnp.uint16(1)
    return arr.at[row, col].set(jax.lax.bitcast_convert_type(x, jnp.bfloat16))


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


def fault_check(cs: Carry, run, consts, pop, ps, m) -> dict:
    """Per canary mode: flips bit 0 of the first K element (byte 0, hashed by PARTIAL and ALL) of request 1's
    position-1 slot in layer 0, runs one call, decodes the new violations, flips the bit back."""
    out = {}
    slot = int(pop["r2t"][1, 1])
    row, col = slot // ps, (slot % ps) * m.kv_dim
    for x in cs.states:
        if x not in run:
            continue
        before = int(cs.states[x].log.write_index[0])
        cs.flip(row, col)
        cs.call(run[x], x, consts)
        cs.flip(row, col)
        after = int(cs.states[x].log.write_index[0])
        recs = cj.decode_violations(cs.states[x].log, start=before)
        real_kv = [r for r in recs if r.fail_reason_bits & int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH)]
        out[x] = {
            "slot": slot,
            "new_violations": after - before,
            "real_kv_hash_rows": len(real_kv),
            "detected": bool(real_kv),
            "expected": x != "none",
            "tags": sorted({r.tag for r in recs}),
        }
    return out


def plan_of(scn, m, mode, args):
    cfg = canary_config(scn, mode, args.backend)
    return lambda s, bb, tt: canary_plan(s, canary_batch(bb, step_ids(scn, m, bb, tt)), config=cfg)


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
                module, index = hlo_index(prog.as_text())
                logdir = os.path.join(args.trace_dir, f"{scn.name}_part_{sanitize(name)}")
                holder = [c]

                def once(holder=holder, prog=prog, k=k):
                    holder[0] = prog(holder[0], k)
                    return holder[0]

                _, prof = profile_call(once, logdir, module, index, n)
                rec["kernel_sum_us"] = 1e3 * prof.get("kernel_sum_ms", float("nan"))
                rec["kernels"] = [
                    {"kernel": r["kernel"], "us": 1e3 * r["ms_per_step"], "launches": r["launches_per_step"]}
                    for r in prof.get("top_kernels", [])[:12]
                ]
            except Exception as e:  # noqa: BLE001
                rec["profile_error"] = f"{type(e).__name__}: {e}"
        out[name] = rec
    log(f"{scn.name}: parts timed ({len(out)})", t0)
    return out


def canary_split(res: dict) -> dict:
    """Per canary mode: the device time per step of each part from the step's profile, HEAD+TAIL (plan, HEAD,
    TAIL; no sweep), the sweep amortised, and the wall-time difference to ``off``."""
    out = {}
    off = res["modes"].get("off", {})
    off_prof = off.get("profile", {}).get("parts_ms", {})
    for x, mr in res["modes"].items():
        if x == "off":
            continue
        prof = mr.get("profile", {}).get("parts_ms")
        rec = {}
        if "step_ms" in mr and "step_ms" in off:
            rec["wall_delta_ms"] = mr["step_ms"] - off["step_ms"]
            rec["wall_delta_pct_of_roofline"] = 100 * rec["wall_delta_ms"] / res["roofline"]["ms"]
        if prof:
            canary = {k: v for k, v in prof.items() if k not in ("model", "other", "memcpy")}
            rec["parts_ms"] = canary
            rec["head_tail_ms"] = sum(v for k, v in canary.items() if not k.startswith("sweep"))
            rec["head_tail_no_plan_ms"] = sum(
                v for k, v in canary.items() if k.startswith(("head", "tail")) and not k.endswith("_copy")
            )
            rec["copies_ms"] = sum(v for k, v in canary.items() if k.endswith("_copy"))
            rec["sweep_ms_amortised"] = sum(v for k, v in canary.items() if k.startswith("sweep"))
            rec["canary_launches_per_step"] = sum(
                v for k, v in mr["profile"].get("launches_per_step", {}).items() if k in canary
            )
            rec["model_ms"] = prof.get("model", 0.0)
            rec["model_delta_vs_off_ms"] = prof.get("model", 0.0) - off_prof.get("model", 0.0)
            rec["other_ms"] = prof.get("other", 0.0) + prof.get("memcpy", 0.0)
            rec["other_delta_vs_off_ms"] = rec["other_ms"] - off_prof.get("other", 0.0) - off_prof.get("memcpy", 0.0)
        out[x] = rec
    return out


# --- the decode write microbenchmark -------------------------------------------------------------------------
def write_bench(args, t0) -> dict:
    """One write launch of 4096 requests x 1 token (each seeded by its previous token), NONE mode, timed with
    ``harness.time_jax`` (a donating fori_loop of launches minus an empty program)."""
    reqs = 64 if args.small else 4096
    n_slots = 2 * reqs + 16
    buf = cj.allocate_canary_buffer(n_slots)
    lg = cj.ViolationLog.allocate(ring_capacity=64)
    first = np.arange(1, reqs + 1)
    second = first + reqs
    ids = np.random.default_rng(3).integers(0, 1 << 30, 2 * reqs)
    ctx = harness.make_context(buf, lg, (), RealKvHashMode.NONE)
    plan0 = cj.WritePlan.from_requests(counts=[1] * reqs, seed_slots=[-1] * reqs)
    ctx = cj.write(ctx, plan0, ids[:reqs], np.zeros(reqs, np.int64), first, backend=args.backend)
    plan1 = cj.WritePlan.from_requests(counts=[1] * reqs, seed_slots=first)
    consts = (plan1, harness.int64_pairs(ids[reqs:]), harness.int64_pairs(np.ones(reqs)), harness.int64_pairs(second))

    def step(state, c):
        plan, i, p, loc = c
        out = cj.write(
            harness.make_context(state[0], state[1], (), RealKvHashMode.NONE), plan, i, p, loc, backend=args.backend
        )
        return out.canary_buf, out.log

    n = 20 if args.small else 200
    sec, state, info = harness.time_jax(step, (ctx.canary_buf, ctx.log), consts, n=n, reps=args.rounds)
    res = {
        "requests": reqs,
        "us": 1e6 * sec,
        "n": n,
        "compile_s": info["compile_s"],
        "violations": int(state[1].write_index[0]),
        "target_us": WRITE_TARGET_US,
    }
    if args.profile:
        try:  # the same loop again under the profiler: which kernels the launch is made of
            prog = loop_of(step, n).lower(state, consts).compile()
            module, index = hlo_index(prog.as_text())
            holder = [state]

            def once():
                holder[0] = prog(holder[0], consts)
                return holder[0]

            _, prof = profile_call(once, os.path.join(args.trace_dir, "write4096"), module, index, n)
            res["kernel_sum_us"] = 1e3 * prof.get("kernel_sum_ms", float("nan"))
            res["kernels"] = [
                {"kernel": r["kernel"], "us": 1e3 * r["ms_per_step"], "launches": r["launches_per_step"]}
                for r in prof.get("top_kernels", [])[:12]
            ]
        except Exception as e:  # noqa: BLE001
            res["profile_error"] = f"{type(e).__name__}: {e}"
    log(f"write {reqs}x1 NONE: {res['us']:.2f} us", t0)
    return res


# --- report --------------------------------------------------------------------------------------------------
def f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def tables(out: dict) -> str:
    lines = ["## Step time per scenario and mode", ""]
    lines.append(
        "| scenario | mode | step ms | vs off | roofline ms | kernel sum ms | canary device ms/step (HEAD+TAIL / "
        "sweep) | violations clean | fault detected | target |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for name, sres in out.get("scenarios", {}).items():
        if sres.get("error"):
            lines.append(f"| {name} | error: {sres['error'][:80]} |||||||||")
        if "modes" not in sres:
            continue
        roof = sres["roofline"]["ms"]
        for x, mr in sres["modes"].items():
            prof = mr.get("profile", {})
            split = sres.get("canary_split", {}).get(x, {})
            ov = sres.get("overhead_pct", {}).get(x)
            fc = sres.get("fault_check", {}).get(x)
            tgt = "-"
            if x == "partial" and name in TARGETS and ov is not None:
                tgt = f"<= {TARGETS[name]} %: {'met' if ov <= TARGETS[name] else 'MISSED'}"
            if name == "decode128" and x in HEAD_TAIL_TARGET_MS and split.get("head_tail_ms") is not None:
                ht = HEAD_TAIL_TARGET_MS[x]
                tgt += f"; HEAD+TAIL <= {ht} ms: {'met' if split['head_tail_ms'] <= ht else 'MISSED'}"
            lines.append(
                "| "
                + " | ".join(
                    [
                        name,
                        x,
                        f(mr.get("step_ms")),
                        "-" if ov is None else f"{ov:+.2f} %",
                        f(roof),
                        f(prof.get("kernel_sum_ms")),
                        "-"
                        if not split.get("parts_ms")
                        else f"{split['head_tail_ms']:.3f} / {split['sweep_ms_amortised']:.3f}",
                        str(mr.get("violations_clean", "-")),
                        "-" if not fc else f"{fc['detected']} ({fc['new_violations']} rows)",
                        tgt,
                    ]
                )
                + " |"
            )
    lines += ["", "## Canary parts per step (device ms, from the step's profile; sweep amortised)", ""]
    cols = [
        "plan",
        "plan_copy",
        "head_verify",
        "head_write",
        "head_copy",
        "tail_verify",
        "tail_write",
        "tail_copy",
        "sweep_plan",
        "sweep_verify",
        "sweep_copy",
    ]
    lines.append(
        "| scenario | mode | "
        + " | ".join(cols)
        + " | plan+HEAD+TAIL | launches | other vs off | wall delta vs off | delta / roofline |"
    )
    lines.append("|---|---|" + "---|" * (len(cols) + 5))
    for name, sres in out.get("scenarios", {}).items():
        for x, split in sres.get("canary_split", {}).items():
            p = split.get("parts_ms", {})
            lines.append(
                f"| {name} | {x} | "
                + " | ".join(f(p.get(c)) for c in cols)
                + f" | {f(split.get('head_tail_ms'))} | {f(split.get('canary_launches_per_step'), '{:.1f}')}"
                + f" | {f(split.get('other_delta_vs_off_ms'))} | {f(split.get('wall_delta_ms'))}"
                + f" | {f(split.get('wall_delta_pct_of_roofline'), '{:.2f} %')} |"
            )
    lines += ["", "## Parts as their own jitted programs (us per launch: wall / kernel sum)", ""]
    lines.append("| scenario | part | us (wall) | us (kernel sum) | compile s | top kernels |")
    lines.append("|---|---|---|---|---|---|")
    for name, sres in out.get("scenarios", {}).items():
        for part, rec in sres.get("parts_jit", {}).items():
            ks = "; ".join(f"{k['kernel'][:40]} {k['us']:.1f}" for k in rec.get("kernels", [])[:4])
            lines.append(
                f"| {name} | {part} | {f(rec.get('us'), '{:.1f}')} | {f(rec.get('kernel_sum_us'), '{:.1f}')} | "
                f"{rec.get('compile_s', '-')} | {ks or rec.get('error', '-')} |"
            )
    wb = out.get("write4096")
    if wb:
        lines += [
            "",
            f"Decode write {wb.get('requests')} x 1 token, NONE: {f(wb.get('us'), '{:.2f}')} us "
            f"(target <= {WRITE_TARGET_US} us: {'met' if wb.get('us', 1e9) <= WRITE_TARGET_US else 'MISSED'}); "
            f"kernel sum {f(wb.get('kernel_sum_us'), '{:.2f}')} us: "
            + "; ".join(f"{k['kernel'][:40]} {k['us']:.2f} x{k['launches']:.0f}" for k in wb.get("kernels", [])[:8]),
        ]
    return "\n".join(lines)


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
        sh = shared_shapes(all_scns, args.page_size)
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


if __name__ == "__main__":
    main(sys.argv[1:])
