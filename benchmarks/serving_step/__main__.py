"""``python -m benchmarks.serving_step``: runs :func:`benchmarks.serving_step.cli.main` on the command line's flags."""

import sys

from benchmarks.serving_step.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
