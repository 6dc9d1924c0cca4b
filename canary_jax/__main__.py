"""``python -m canary_jax`` / the ``canary-jax`` console script (see :mod:`canary_jax.cli.main`)."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    from canary_jax.cli.main import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
