"""Where the demo's served step spends its time: host (batch conversion, dispatch) against the device wait.

Runs ``canary-jax demo --inject none`` with the canary runtime's ``forward`` (canary on) and ``model_only``
(canary off) wrapped: per call, the time to build the canary batch, to dispatch the jitted step, and to wait for
its outputs. Prints medians over the clean steps (the first two calls, which compile, left out).

Usage (repository root): ``python -m benchmarks.demo_probe [demo args...]``
"""

from __future__ import annotations

import statistics
import sys
import time

import jax

from canary_jax.cli import main as cli_main
from canary_jax.cli.demo import canary_ops

ROWS: dict[str, list[tuple[float, float, float]]] = {"on": [], "off": []}


def _wrap() -> None:
    orig_batch_of = canary_ops.CanaryRuntime._batch_of
    orig_step = canary_ops.served_step
    marks: dict[str, float] = {}

    def batch_of(self, *a, **kw):
        t0 = time.perf_counter()
        out = orig_batch_of(self, *a, **kw)
        marks["batch"] = time.perf_counter() - t0
        return out

    def served_step(*a, **kw):
        t0 = time.perf_counter()
        out = orig_step(*a, **kw)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        key = "on" if kw.get("canary", True) else "off"
        ROWS[key].append((marks.pop("batch", 0.0) if key == "on" else 0.0, t1 - t0, t2 - t1))
        return out

    canary_ops.CanaryRuntime._batch_of = batch_of
    canary_ops.served_step = served_step


def main() -> None:
    _wrap()
    sys.argv = ["canary-jax", "demo", "--no-progress", "--inject", "none", *sys.argv[1:]]
    try:
        cli_main.main()
    except SystemExit:
        pass
    for key, rows in ROWS.items():
        rows = rows[2:]
        if not rows:
            continue
        cols = list(zip(*rows))
        med = [statistics.median(c) * 1e3 for c in cols]
        print(f"demo_probe {key}: n={len(rows)} batch {med[0]:.3f} ms, dispatch {med[1]:.3f} ms, wait {med[2]:.3f} ms")


if __name__ == "__main__":
    main()
