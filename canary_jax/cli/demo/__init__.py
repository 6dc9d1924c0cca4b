"""``canary-jax demo``: a small paged-KV serving engine under the KV canary, with fault injection.

Modules: :mod:`~canary_jax.cli.demo.model` (the transformer and its bf16 paged KV pools),
:mod:`~canary_jax.cli.demo.radix` (page allocator and prefix cache), :mod:`~canary_jax.cli.demo.scheduler`
(admission, batching, page lifetime), :mod:`~canary_jax.cli.demo.config` (engine sizes),
:mod:`~canary_jax.cli.demo.engine` (the per-forward flow), :mod:`~canary_jax.cli.demo.canary_ops` (the served
step as one program: plan, HEAD, the model, TAIL via the runtime's ``canary_step``; and the SWEEP),
:mod:`~canary_jax.cli.demo.sharded` (``--devices N``: KV pools and canary sharded by KV heads),
:mod:`~canary_jax.cli.demo.faults` (fault kinds; their base class and shared pickers in
:mod:`~canary_jax.cli.demo.fault_base`), :mod:`~canary_jax.cli.demo.campaign` (clean phase + fault
episodes), :mod:`~canary_jax.cli.demo.summary` (the report as plain data) and
:mod:`~canary_jax.cli.demo.workload` (prompts and requests). Tables and the chart are drawn by
:mod:`canary_jax.cli.render` and :mod:`canary_jax.cli.chart`, saved state is decoded by
:mod:`canary_jax.cli.verify_dump`, and :mod:`canary_jax.cli.main` runs the command.
"""
