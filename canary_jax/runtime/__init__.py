"""The serving-step runtime around the kernels (SGLang ``python/sglang/srt/kv_canary/``).

Modules:

* :mod:`~canary_jax.runtime.groups`: canary buffer groups (HEAD / TAIL buffers and LUT of one pool; never KV
  data) and :class:`~canary_jax.runtime.groups.PoolKind`.
* :mod:`~canary_jax.runtime.endpoints`: HEAD / TAIL / SWEEP endpoints built from a group, and their dispatch.
* :mod:`~canary_jax.runtime.state`: the per-forward step's types (config, batch, state, plans, summary).
* :mod:`~canary_jax.runtime.step`: the per-forward step API (plan, HEAD, TAIL, step, sweep): validate, convert,
  pad eager calls to buckets, then run :mod:`~canary_jax.runtime.phases` (the traced bodies and jitted
  programs); :mod:`~canary_jax.runtime.shapes` pads.
* :mod:`~canary_jax.runtime.sweep`: sweep plans over cached prefixes.
* :mod:`~canary_jax.runtime.report`: violation reporting, stats, health checks (host side).

The runtime builds on the contract modules of :mod:`canary_jax` only: it never imports the command-line
tools (:mod:`canary_jax.cli`), the Pallas kernels, :mod:`interop` or torch at import time (the Pallas
backend is loaded by :func:`canary_jax.launch.verify` / :func:`canary_jax.launch.write` when chosen).
"""
