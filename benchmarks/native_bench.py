"""GPU figures for the native torch path (issue #15): host time per launch (native, DLPack, JAX-launched), device
time against the JAX path, and a captured step's replay time.

Setup: ``benchmarks.interop_setup.Setup`` (canary ``uint8[N, 32]``, layer-0 K as ``bf16[N, 64]`` = 128 bytes per
slot, PARTIAL mode), Pallas backend. Cases: ``verify`` tiny (64 entries) and full (``--cap`` entries), ``write``
tiny (1 x 1 token) and full (32 x 8 tokens), ``plan`` (32 request rows, ``--cap`` verify capacity).

Per case and path:

* ``host_us``: host time per launch, read *before* the device sync (what the launch costs the host thread; the
  GPU runs behind it): the median over 10 batches of 20 back-to-back launches, after 10 warm-up launches; ``native``
  with the launchers' own graph replay (:mod:`interop.native.replay`, the default), ``native_eager`` with it off (a
  launch whose key was seen skips its checks), ``native_checked`` with it off and the memo of checked launch keys
  emptied before each launch, its layout memo kept (what fresh tensors of a layout already seen cost, a decode
  step's token tensors without CUDA graphs; ``benchmarks/eager_profile.py --unseen`` empties both);
* ``wall_us``: the same 200 launches and the final sync, per launch (throughput);
* ``device_us`` (native): a torch CUDA graph of 20 launches replayed, timed with CUDA events, divided by 20;
* ``device_us`` (JAX): the launch's own jitted program (the DLPack path's, ``interop.runner.last_launch_program``)
  looped 20 times inside one jitted ``fori_loop`` on JAX-side copies, wall time of one call with a block,
  divided by 20 (one dispatch, so device-bound).

The captured step: plan + HEAD verify + HEAD write + TAIL verify + TAIL write of a decode batch (``--decode-bs``
requests x 1 token, ``--decode-ctx`` tokens of context each) in one torch CUDA graph; ``replay_host_us`` =
wall time of ``graph.replay()`` before a sync, ``replay_device_us`` = CUDA-event time per replay.

Usage (from the repository root): ``python -m benchmarks.native_bench --out DIR [--slots N] [--cap C]``;
``INTEROP_BENCH_DEVICE=cpu`` is a dry run on CPU tensors (host times only, the kernels interpreted).
Writes ``DIR/native_bench.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import traceback

import jax
import torch

from benchmarks import harness, interop_setup
from benchmarks.interop_setup import DEV, Setup, sync
from interop import runner, sglang, sglang_launch
from interop.native import launch as native
from interop.native import replay


def host_and_wall(fn, n=200, warm=10, batches=10):
    """``(host, wall)`` µs per launch: ``host`` the median over ``batches`` batches of ``n / batches`` back-to-back
    launches of the batch's time per launch, read before any sync (a shared host's hiccups hit a few batches, not
    the median); ``wall`` all ``n`` launches and the final sync, per launch."""
    for _ in range(warm):
        fn()
    sync()
    per = max(1, n // batches)
    host = []
    t0 = time.perf_counter()
    for _ in range(batches):
        b0 = time.perf_counter()
        for _ in range(per):
            fn()
        host.append((time.perf_counter() - b0) / per * 1e6)
    sync()
    wall = (time.perf_counter() - t0) / (per * batches) * 1e6
    host.sort()
    return round(host[len(host) // 2], 1), round(wall, 1)


def graph_device_us(fn, k=20, reps=20):
    """Per-launch device time of ``fn`` from a CUDA graph of ``k`` launches (median of ``reps`` replays)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(k):
            fn()
    g.replay()
    sync()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / k)
    times.sort()
    return round(times[len(times) // 2], 2), g


def jax_device_us(dlpack_launch, k=20):
    """Per-launch device time of the DLPack path's own program, looped ``k`` times in one jitted call."""
    dlpack_launch()
    sync()
    fn, mut, views, _dev = runner.last_launch_program()
    fence = interop_setup._TWIN_FENCE[0][1] if interop_setup._TWIN_FENCE else None
    if fence is None:
        interop_setup.program_twin(dlpack_launch)
        fence = interop_setup._TWIN_FENCE[0][1]
    copies = [v.clone() for v in views]
    bufs = [interop_setup.dlpack._import_exact(c, name="twin") for c in copies]

    @jax.jit
    def loop(fence, *bufs):
        def body(i, m):
            full = list(bufs)
            for j, x in zip(mut, m):
                full[j] = x
            return tuple(fn(fence, *full))

        return jax.lax.fori_loop(0, k, body, tuple(bufs[j] for j in mut))

    jax.block_until_ready(loop(fence, *bufs))
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(fence, *bufs))
        times.append((time.perf_counter() - t0) * 1e6 / k)
    times.sort()
    return round(times[len(times) // 2], 2)


def plan_args(s: Setup, cap: int):
    """A plan launch of 32 request rows whose prefixes are the setup's stamped prefix slots."""
    reqs, per = interop_setup.REQS, s.per
    r2t = torch.zeros(reqs + 1, per + interop_setup.WRITE_TOKENS, dtype=torch.int32, device=DEV)
    r2t[1:, :per] = s.prefix_slots.to(torch.int32)
    r2t[1:, per:] = s.new_slots.to(torch.int32)
    vp = sglang.VerifyPlan.allocate(verify_capacity=cap, device=DEV)
    wp = sglang.WritePlan.allocate(write_req_capacity=reqs, device=DEV)
    return dict(verify_plan_out=vp, write_plan_out=wp, **full_plan_kw(r2t, per, interop_setup.WRITE_TOKENS, cap))


def full_plan_kw(r2t, prefix: int, extend: int, cap: int) -> dict:
    """Plan keyword arguments for rows ``1..bs`` of ``r2t`` (``bs = r2t.shape[0] - 1``), each with ``prefix``
    cached and ``extend`` new tokens, no SWA, no expected-token pool."""
    bs = r2t.shape[0] - 1
    return dict(
        req_pool_indices=torch.arange(1, bs + 1, device=DEV),
        prefix_lens=torch.full((bs,), prefix, device=DEV),
        extend_seq_lens=torch.full((bs,), extend, device=DEV),
        req_to_token=r2t,
        swa_window_size=0,
        full_to_swa_index_mapping=None,
        verify_capacity=cap,
        req_to_verify_expected_tokens=None,
        req_to_verify_expected_tokens_valid_lens=None,
        kv_token_id_vs_position_offset=0,
    )


def bench_cases(s: Setup, cap: int, results: list, log):
    cases = []
    for tiny in (True, False):
        vp = s.verify_plan(tiny)
        cases.append(("verify", "tiny" if tiny else "full", vp, None))
        launch, stamp, entries = s.write_args(tiny, "pallas")
        cases.append(("write", "tiny" if tiny else "full", launch, stamp))
    cases.append(("plan", "full", plan_args(s, cap), None))
    for op, case, obj, stamp in cases:
        row = dict(op=op, case=case)
        try:
            if stamp is not None:
                stamp()
            for variant in ("native", "native_eager", "native_checked", "dlpack"):
                path = variant.removesuffix("_eager").removesuffix("_checked")
                # native: the launchers replay their own CUDA graph once a launch repeats; native_eager: replay
                # off ($CANARY_JAX_NATIVE_GRAPHS=0), every launch runs its checks, staging and program
                eager = variant in ("native_eager", "native_checked")
                os.environ[replay.GRAPHS_ENV] = "0" if eager else str(replay.DEFAULT_MAX_GRAPHS)
                replay.GRAPHS.clear()
                if op == "verify":

                    def fn(path=path, vp=obj):
                        sglang.launch_canary_verify_kernel(
                            context=s.ctx, plan=vp, check_verify_expected_token=False, backend="pallas", path=path
                        )
                elif op == "write":
                    os.environ[native.PATH_ENV] = path  # Setup's write launch takes no path keyword

                    def fn(obj=obj):
                        obj()
                else:

                    def fn(path=path, kw=obj):
                        sglang.launch_canary_plan_kernels(path=path, **kw)

                if variant == "native_checked" and not hasattr(sglang_launch, "forget_checked"):
                    continue  # a tree without the memo (a baseline run of this file)
                if variant == "native_checked":

                    def fn(inner=fn):
                        sglang_launch.forget_checked(layouts=False)
                        inner()

                host, wall = host_and_wall(fn)
                row[f"{variant}_host_us"], row[f"{variant}_wall_us"] = host, wall
                if DEV != "cuda" or eager:  # CPU dry run: host times only
                    continue
                if path == "native":
                    row["native_device_us"], _ = graph_device_us(fn)
                else:
                    row["jax_device_us"] = jax_device_us(fn)
                    _, row["jax_launched_us"] = None, interop_setup.timeit(interop_setup.program_twin(fn)[0])[0]
            os.environ.pop(native.PATH_ENV, None)
            os.environ.pop(replay.GRAPHS_ENV, None)
        except Exception as e:  # a failing case is reported, the others still run
            row["error"] = f"{type(e).__name__}: {e}"
            log(traceback.format_exc())
        results.append(row)
        log(json.dumps(row))


def bench_step(s: Setup, bs: int, ctx_len: int, results: list, log):
    """A decode step (bs requests x 1 token, ctx_len context) captured in one graph."""
    row = dict(op="captured_step", bs=bs, ctx=ctx_len)
    try:
        n = s.n
        g = torch.Generator(device=DEV).manual_seed(1)
        slots = (torch.randperm(n - 1, generator=g, device=DEV)[: bs * (ctx_len + 1)] + 1).reshape(bs, ctx_len + 1)
        r2t = torch.zeros(bs + 1, ctx_len + 1, dtype=torch.int32, device=DEV)
        r2t[1:] = slots.to(torch.int32)
        cap = bs * ctx_len
        head = torch.zeros(n, 32, dtype=torch.uint8, device=DEV)
        ctx_head = s.state.context(canary_buf=head, kernel_kind=sglang.CanaryLaunchTag.HEAD_K_FULL)
        vp = sglang.VerifyPlan.allocate(verify_capacity=cap, device=DEV)
        wp = sglang.WritePlan.allocate(write_req_capacity=bs, device=DEV)
        plan_kw = full_plan_kw(r2t, ctx_len, 1, cap)
        write_kw = dict(
            input_ids=torch.randint(0, 50000, (bs,), device=DEV),
            positions=torch.full((bs,), ctx_len, device=DEV),
            out_cache_loc=slots[:, ctx_len].contiguous(),
            enable_write_input_assert=False,
            expected_input_tokens=None,
            expected_input_positions=None,
        )

        def step():
            sglang.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, path="native", **plan_kw)
            for c in (ctx_head, s.ctx):
                sglang.launch_canary_verify_kernel(
                    context=c, plan=vp, check_verify_expected_token=False, backend="pallas", path="native"
                )
                sglang.launch_canary_write_kernel(context=c, plan=wp, backend="pallas", path="native", **write_kw)

        row["eager_host_us"], row["eager_wall_us"] = host_and_wall(step, n=50)
        if DEV != "cuda":
            raise RuntimeError("CPU dry run: no CUDA graph")
        dev_us, graph = graph_device_us(step, k=1)
        row["replay_device_us"] = dev_us
        row["replay_host_us"], row["replay_wall_us"] = host_and_wall(graph.replay, n=200)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
        log(traceback.format_exc())
    results.append(row)
    log(json.dumps(row))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="native_bench_out")
    ap.add_argument("--slots", type=int, default=1 << 20)
    ap.add_argument("--cap", type=int, default=32768)
    ap.add_argument("--decode-bs", type=int, default=128)
    ap.add_argument("--decode-ctx", type=int, default=256)
    ap.add_argument(
        "--pallas-config", default=None, help="JSON of PallasConfig fields replacing the defaults for every launch"
    )
    a = ap.parse_args()
    harness.apply_pallas_config(a.pallas_config)
    os.makedirs(a.out, exist_ok=True)
    log = interop_setup.tee_log(os.path.join(a.out, "native_bench_log.txt"), "w")

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    meta = dict(
        date=time.strftime("%Y-%m-%d"),
        gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
        torch=torch.__version__,
        jax=jax.__version__,
        triton=triton_version,
        python=platform.python_version(),
        slots=a.slots,
        cap=a.cap,
        pallas_config=a.pallas_config,
    )
    log(json.dumps(meta))
    results: list = []
    s = Setup(a.slots, a.cap)
    bench_cases(s, a.cap, results, log)
    bench_step(s, a.decode_bs, a.decode_ctx, results, log)
    with open(os.path.join(a.out, "native_bench.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    keys = ("native_host_us", "native_eager_host_us", "native_checked_host_us", "dlpack_host_us", "jax_launched_us")
    keys += ("native_device_us", "jax_device_us")
    log("op       case  " + "  ".join(f"{k:>16}" for k in keys))
    for r in results:
        if r["op"] == "captured_step":
            times = {k: v for k, v in r.items() if k.endswith("us")}
            log(f"captured_step bs={r['bs']} ctx={r['ctx']}: {json.dumps(times)}")
            continue
        log(f"{r['op']:8} {r['case']:5} " + "  ".join(f"{r.get(k, '-')!s:>16}" for k in keys))


if __name__ == "__main__":
    main()
