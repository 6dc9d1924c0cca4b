"""The ``canary-jax`` command-line tools: ``demo`` (a paged-KV serving loop under the canary with a fault
campaign, :mod:`canary_jax.cli.demo`) and ``verify-dump`` (decode a saved ring or canary buffer,
:mod:`canary_jax.cli.verify_dump`). :mod:`canary_jax.cli.main` parses the command line.

The demo's progress bar and chart need the ``demo`` extra (``pip install 'canary-jax[demo]'``).
"""
