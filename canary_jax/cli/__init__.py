"""The ``canary-jax`` command-line tools (the top layer: they import the runtime and the contract, never the
reverse).

* :mod:`~canary_jax.cli.main`: the entry point (``canary-jax`` / ``python -m canary_jax``); dispatches to
  ``demo`` and ``verify-dump``.
* :mod:`~canary_jax.cli.args`: the parser, exit codes and :class:`~canary_jax.cli.args.UsageError`.
* :mod:`~canary_jax.cli.outputs`: output files (``--json``, ``--plot``, ``--dump``), checked before a run.
* :mod:`~canary_jax.cli.progress`: the demo's progress bar.
* :mod:`~canary_jax.cli.render`: the demo's text tables and PNG chart, and verify-dump's tables.
* :mod:`~canary_jax.cli.verify_dump`: ``verify-dump``: decodes a saved ring, canary buffer or dump file.
* :mod:`canary_jax.cli.demo`: ``demo``: the serving loop under the canary and its fault campaign.

The progress bar (tqdm) and the chart (matplotlib) need the ``demo`` extra
(``pip install 'canary-jax[demo]'``); both are imported only when used. Without tqdm the demo runs with no
bar; ``--plot`` without matplotlib is refused with exit status 2.
"""
