"""``canary-jax demo``: a small paged-KV serving engine under the KV canary, with fault injection.

Modules: :mod:`model` (the transformer and its bf16 paged KV pools), :mod:`radix` (page allocator and prefix
cache), :mod:`engine` (scheduler and the per-forward canary flow), :mod:`canary_ops` (HEAD / TAIL / SWEEP
launches), :mod:`faults` (fault kinds), :mod:`campaign` (clean phase + fault episodes, summary),
:mod:`workload` (prompts and sizes). Tables and the chart are drawn by :mod:`canary_jax.cli.render`, saved
state is decoded by :mod:`canary_jax.cli.verify_dump`, and :mod:`canary_jax.cli.main` parses the command line.
"""
