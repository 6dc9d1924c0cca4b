"""Where an eager (not replayed) native launch spends host time (issue #26): per launcher (verify tiny, write tiny,
write full, plan), host time per launch before the sync (200 back-to-back launches, the CUDA graph replay off), then
a cProfile of those launches (top functions by own time and by cumulative time). Usage:
``python -m benchmarks.eager_profile [--top N] [--inference] [--unseen]`` on a GPU (``--unseen``: the memos of
checked launches and layouts emptied before each launch, so every check runs, as for a launch shape not seen;
``INTEROP_BENCH_DEVICE=cpu`` profiles the CPU dry run, where the kernels are interpreted)."""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats

import torch

from benchmarks.interop_setup import Setup, sync
from benchmarks.native_bench import host_and_wall, plan_args
from interop import sglang, sglang_launch
from interop.native import launch as native
from interop.native import replay


def cases(s: Setup, cap: int) -> dict:
    out = {}
    for tiny in (True, False):
        vp = s.verify_plan(tiny)
        name = "tiny" if tiny else "full"
        out[f"verify_{name}"] = (
            lambda vp=vp: sglang.launch_canary_verify_kernel(
                context=s.ctx, plan=vp, check_verify_expected_token=False, backend="pallas", path="native"
            ),
            None,
        )
        launch, stamp, _ = s.write_args(tiny, "pallas")
        out[f"write_{name}"] = (launch, stamp)
    kw = plan_args(s, cap)
    out["plan"] = (lambda: sglang.launch_canary_plan_kernels(path="native", **kw), None)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--slots", type=int, default=1 << 16)
    ap.add_argument("--cap", type=int, default=2048)
    ap.add_argument("--inference", action="store_true")
    ap.add_argument("--unseen", action="store_true")
    a = ap.parse_args()
    os.environ[replay.GRAPHS_ENV] = "0"
    os.environ[native.PATH_ENV] = "native"
    mode = torch.inference_mode() if a.inference else contextlib.nullcontext()
    with mode:
        s = Setup(a.slots, a.cap)
        for name, (fn, stamp) in cases(s, a.cap).items():
            if stamp is not None:
                stamp()
            if a.unseen:

                def fn(inner=fn):
                    sglang_launch.forget_checked()
                    inner()

            host, wall = host_and_wall(fn, n=200)
            print(f"== {name}: eager host {host:.1f} us/launch, wall {wall:.1f} us/launch", flush=True)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                fn()
            prof.disable()
            sync()
            for key in ("tottime", "cumulative"):
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(a.top)
                print(buf.getvalue(), flush=True)


if __name__ == "__main__":
    main()
