"""The serving-step runtime around the kernels (SGLang ``python/sglang/srt/kv_canary/``).

Modules: :mod:`endpoints` (canary buffer groups, HEAD / TAIL / SWEEP endpoints and their dispatch),
:mod:`step` (the jit-able per-forward step API: plan, HEAD, TAIL, sweep), :mod:`sweep` (sweep plans over
cached prefixes) and :mod:`report` (violation reporting, stats, health checks). The runtime builds on the
contract modules of :mod:`canary_jax` and never imports the Pallas kernels or torch at import time.
"""
