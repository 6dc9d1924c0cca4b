"""``canary-jax demo``: a small paged-KV serving engine under the KV canary, with fault injection.

Modules: :mod:`model` (the transformer and its bf16 paged KV pools), :mod:`radix` (page allocator and prefix
cache), :mod:`engine` (scheduler and the per-forward canary flow), :mod:`canary_ops` (HEAD / TAIL / SWEEP
launches), :mod:`faults` (fault kinds), :mod:`campaign` (clean phase + fault episodes, summary),
:mod:`render` (tables, chart), :mod:`dump` (saved-state decoding), :mod:`cli` (the command line).
"""
