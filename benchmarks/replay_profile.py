"""Where a replayed native launch spends host time (issue #15): the launch, its replay key alone, the graph
replay alone, and a cProfile of 1000 launches. Usage: ``python -m benchmarks.replay_profile`` on a GPU."""

from __future__ import annotations

import cProfile
import pstats

import torch

from benchmarks.interop_setup import Setup, sync
from benchmarks.native_bench import host_and_wall
from interop import arguments, sglang
from interop.native import replay


def per_call_us(fn, n=2000):
    """Host time per call (µs, before the sync), after 20 warm-up calls: :func:`native_bench.host_and_wall`'s."""
    return host_and_wall(fn, n=n, warm=20)[0]


def main():
    s = Setup(1 << 20, 32768)
    vp = s.verify_plan(True)

    def verify():
        sglang.launch_canary_verify_kernel(context=s.ctx, plan=vp, check_verify_expected_token=False)

    def key():
        return sglang.verify_replay_key(s.ctx, vp, False, backend=None, path=None)

    verify()
    verify()
    k = key()
    assert k is not None and replay.GRAPHS.replay(k), "no graph for the verify launch"
    entry = replay.GRAPHS._graphs[k]
    print("launch (replayed) us", per_call_us(verify))
    print("replay key us", per_call_us(key))
    print("GRAPHS.replay(key) us", per_call_us(lambda: replay.GRAPHS.replay(k)))
    print("graph.replay() us", per_call_us(entry.graph.replay))
    print("is_current_stream_capturing us", per_call_us(torch.cuda.is_current_stream_capturing))
    print("context field reads us", per_call_us(lambda: [getattr(s.ctx, f) for f in arguments.CONTEXT_FIELDS]))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(1000):
        verify()
    pr.disable()
    sync()
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
