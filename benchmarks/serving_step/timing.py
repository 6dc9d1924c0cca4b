"""Timing helpers: the wall time of a blocking call, concurrent compiles of lowered programs, the progress log."""

from __future__ import annotations

import concurrent.futures
import time
import traceback

import jax


def wall(fn, *a):
    t = time.perf_counter()
    out = jax.block_until_ready(fn(*a))
    return time.perf_counter() - t, out


def _compile_one(lowered):
    t = time.perf_counter()
    try:
        return lowered.compile(), time.perf_counter() - t
    except Exception as e:  # noqa: BLE001 - reported per program
        traceback.print_exc()
        return e, time.perf_counter() - t


def compile_all(jobs: dict, workers: int) -> dict:
    """``{key: lowered}`` compiled concurrently (XLA / Triton compile outside the GIL): ``{key: (compiled or
    exception, seconds)}``."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as ex:
        futs = {k: ex.submit(_compile_one, v) for k, v in jobs.items()}
        return {k: f.result() for k, f in futs.items()}


def log(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)
