"""Where a replayed native launch spends host time (issues #15, #26): per launcher (verify, write, plan), the whole
replayed launch, its replay key alone, the key's graph lookup and replay, and ``graph.replay()`` alone; then a
cProfile of 1000 replayed write launches. Usage: ``python -m benchmarks.replay_profile [--inference]`` on a GPU
(``--inference``: every launch inside ``torch.inference_mode()``, as serving engines run)."""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats

import torch

from benchmarks.interop_setup import Setup, sync
from benchmarks.native_bench import host_and_wall, plan_args
from interop import sglang
from interop.native import replay


def per_call_us(fn, n=2000):
    """Host time per call (µs, before the sync), after 20 warm-up calls: :func:`native_bench.host_and_wall`'s."""
    return host_and_wall(fn, n=n, warm=20)[0]


def _split(name, launch, key) -> dict:
    launch()
    launch()
    k = key()
    assert k is not None and replay.GRAPHS.replay(k), f"no graph for the {name} launch"
    entry = replay.GRAPHS._graphs[k]
    out = {
        "launch_replayed_us": per_call_us(launch),
        "key_us": per_call_us(key),
        "lookup_and_replay_us": per_call_us(lambda: replay.GRAPHS.replay(k)),
        "graph_replay_us": per_call_us(entry.graph.replay),
    }
    print(name, json.dumps(out), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inference", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    mode = torch.inference_mode() if a.inference else contextlib.nullcontext()
    with mode:
        s = Setup(1 << 20, 32768)
        vp = s.verify_plan(True)
        write, _, _ = s.write_args(False, "pallas")
        cl = dict(zip(write.__code__.co_freevars, (c.cell_contents for c in write.__closure__)))
        wp, kw = cl["wp"], cl["kw"]
        pa = plan_args(s, 32768)
        res = {"inference_mode": a.inference}

        def verify():
            sglang.launch_canary_verify_kernel(context=s.ctx, plan=vp, check_verify_expected_token=False)

        def verify_key():
            return sglang.verify_replay_key(s.ctx, vp, False, backend=None, path=None)

        def write_key():
            tokens = (kw["input_ids"], kw["positions"], kw["out_cache_loc"], None, None)
            return sglang.write_replay_key(s.ctx, wp, tokens, False, backend="pallas", path=None)

        def plan():
            sglang.launch_canary_plan_kernels(**pa)

        res["verify"] = _split("verify", verify, verify_key)
        res["write"] = _split("write", write, write_key)
        res["plan_launch_replayed_us"] = per_call_us(plan)
        print("plan launch replayed us", res["plan_launch_replayed_us"])
        res["is_current_stream_capturing_us"] = per_call_us(torch.cuda.is_current_stream_capturing)
        res["current_device_us"] = per_call_us(torch.cuda.current_device)
        print(json.dumps(res), flush=True)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(1000):
            write()
        pr.disable()
        sync()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
