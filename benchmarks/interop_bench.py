"""GPU figures for the torch interop: per-call overhead of torch-launched verify / write versus the same
program launched from JAX, where that overhead goes, and the cost at 1M and 16M slots.

For each pool size N (canary ``uint8 [N, 32]``, one real-KV source = layer-0 K as ``bf16 [N, 64]``, i.e.
128 bytes per slot, PARTIAL mode) and each backend, two cases (``--cases``, tiny first):

* ``tiny``: verify 64 clean entries (request 0's first 64 positions), write 1 request x 1 token; the fixed
  per-call cost.
* ``full``: verify C = ``--cap`` clean entries (32 requests x C/32 positions), write 32 requests x 8 tokens.

The verified slots are stamped beforehand by the case's own write program (64 one-token writes, or C/256
writes of 32 x 8 tokens), so stamping compiles nothing extra and no violation fires.

Each op is timed (a) torch-launched through ``interop.sglang`` on the torch tensors, (b) JAX-launched: the
very same jitted program (``interop.runner.last_launch_program``) called from JAX on JAX-side copies of its
inputs, donating, without the torch handshake; nothing extra to compile. ``us_per_call`` = wall time of 100
back-to-back launches then one device sync (throughput; what a serving loop pays), ``latency_us`` = median
over 30 single launches each followed by a device sync. ``overhead_us`` = torch - JAX. ``--api-twin`` also
times ``canary_jax.verify`` / ``canary_jax.write`` on JAX-owned copies (compiles two more programs).

Attribution (tiny case, first size): the launch's host time per phase (``interop.runner.phase_times``), the
stream modes ``fence`` / ``host`` / ``none`` and the alias-check modes ``first`` (default) / ``every``, and
``overhead_profile``: each handshake step timed alone.

Usage (from the repository root): python -m benchmarks.interop_bench --out DIR [--sizes 1048576 16777216]
       [--backends pallas reference] [--cases tiny full] [--deadline-s S]
Writes DIR/interop_gpu.json, DIR/interop_gpu.md (rewritten after every case) and DIR/interop_gpu_log.txt.
``INTEROP_BENCH_DEVICE=cpu`` runs the same code on CPU tensors (dry run), e.g.
``INTEROP_BENCH_DEVICE=cpu python -m benchmarks.interop_bench --out DIR --sizes 4096 --cap 2048 --backends
reference --cases tiny``. Setup, JAX twins and the timer: ``benchmarks.interop_setup``; figures:
``benchmarks/results/interop_gpu.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import jax
import torch

import canary_jax
from benchmarks import interop_setup
from interop import dlpack, runner, sglang, streams


def _rows_for(op, case, entries, thr, lat, jthr, jlat, rep, viol, n_slots, backend, extra=None):
    row = dict(
        slots=n_slots,
        backend=backend,
        op=op,
        case=case,
        entries=entries,
        torch_us_per_call=thr,
        jax_us_per_call=jthr,
        overhead_us=round(thr - jthr, 1) if jthr is not None else None,
        torch_latency_us=lat,
        jax_latency_us=jlat,
        aliased=rep["aliased"],
        copied_back=rep["copied_back"],
        violations_during_timing=viol,
    )
    if extra:
        row.update(extra)
    return row


def attribution(tv, tw, results, log, n_slots, backend):
    """Tiny launches: host time per phase; stream modes x alias-check modes."""
    out = {}
    for op, fn in (("verify", tv), ("write", tw)):
        for alias in ("first", "every"):
            runner.set_alias_check(alias)
            for _ in range(5):
                fn()
            interop_setup.sync()
            runner.set_phase_timing(True)
            for _ in range(100):
                fn()
            interop_setup.sync()
            out[f"{op} phases (fence, alias check {alias})"] = runner.phase_times()
            runner.set_phase_timing(False)
        runner.set_alias_check("first")
        modes = {}
        for sync_mode in ("fence", "host", "none"):
            for alias in ("first", "every"):
                streams.set_stream_sync(sync_mode)
                runner.set_alias_check(alias)
                try:
                    modes[f"{sync_mode}/{alias}"] = interop_setup.timeit(fn)
                finally:
                    streams.set_stream_sync("fence")
                    runner.set_alias_check("first")
        out[f"{op} stream/alias modes (us/call, latency us)"] = modes
        log(f"  attribution {op}: modes {modes}")
        for alias in ("first", "every"):
            log(f"  attribution {op} phases alias={alias}: {out[f'{op} phases (fence, alias check {alias})']}")
    results.append(dict(slots=n_slots, backend=backend, attribution=out))


def bench_case(s, backend, tiny, results, log, *, attribute, api_twin):
    case = "tiny" if tiny else "full"
    n_slots = s.n
    tw, stamp, w_entries = s.write_args(tiny, backend)
    t0 = time.perf_counter()
    stamp()
    log(
        f"N={n_slots} {backend} {case}: stamped the verified prefix with the write program in "
        f"{time.perf_counter() - t0:.1f}s (incl. its compile)"
    )
    vp = s.verify_plan(tiny)

    def tv():
        sglang.launch_canary_verify_kernel(context=s.ctx, plan=vp, check_verify_expected_token=False, backend=backend)

    t0 = time.perf_counter()
    tv()
    interop_setup.sync()
    log(f"  {case}: first torch verify (compile) {time.perf_counter() - t0:.1f}s")
    before = int(s.state.violation_write_index.item())
    v_thr, v_lat = interop_setup.timeit(tv)
    v_rep = runner.last_launch_report()
    w_thr, w_lat = interop_setup.timeit(tw)
    w_rep = runner.last_launch_report()
    viol = int(s.state.violation_write_index.item()) - before
    jv, jv_blk = interop_setup.program_twin(tv)
    jv_thr, jv_lat = interop_setup.timeit(jv, block=jv_blk)
    jw, jw_blk = interop_setup.program_twin(tw)
    jw_thr, jw_lat = interop_setup.timeit(jw, block=jw_blk)
    v_entries = int(vp.verify_slot_indices.shape[0])
    for op, thr, lat, jthr, jlat, rep, ent in (
        ("verify", v_thr, v_lat, jv_thr, jv_lat, v_rep, v_entries),
        ("write", w_thr, w_lat, jw_thr, jw_lat, w_rep, w_entries),
    ):
        row = _rows_for(
            op,
            case,
            ent,
            thr,
            lat,
            jthr,
            jlat,
            rep,
            viol,
            n_slots,
            backend,
            dict(jax_twin="same jitted program from JAX"),
        )
        results.append(row)
        log("  " + json.dumps(row))
    if attribute:
        attribution(tv, tw, results, log, n_slots, backend)
    if api_twin:
        api_twin_rows(s, backend, tiny, vp, results, log)


def api_twin_rows(s, backend, tiny, vp, results, log):
    """canary_jax.verify / write on JAX-owned copies (separate programs: compiles)."""
    jctx = s.jax_context()
    jvp = interop_setup.jax_verify_plan(vp)
    holder = {"ctx": jctx}

    def jv():
        holder["ctx"] = canary_jax.verify(holder["ctx"], jvp, check_verify_expected_token=False, backend=backend)

    blk = lambda: jax.block_until_ready(holder["ctx"].log.write_index)  # noqa: E731
    t0 = time.perf_counter()
    jv()
    blk()
    log(f"  api twin verify first call (compile) {time.perf_counter() - t0:.1f}s")
    thr, lat = interop_setup.timeit(jv, block=blk)
    results.append(
        dict(
            slots=s.n,
            backend=backend,
            op="verify",
            case="tiny" if tiny else "full",
            canary_jax_api_us_per_call=thr,
            canary_jax_api_latency_us=lat,
        )
    )
    log(f"  api twin verify: {thr} us/call, latency {lat}")


def overhead_profile(results, log):
    """Where a torch launch's per-call cost goes: each handshake step timed alone (no canary compile; the one
    program is the donation probe's ``x + 1`` on int32[16])."""
    t = torch.zeros(64, dtype=torch.uint8, device=interop_setup.DEV)
    g = jax.jit(lambda x: x + 1, donate_argnums=0)
    src = torch.zeros(16, dtype=torch.int32, device=interop_setup.DEV)
    holder = {"x": dlpack._import_exact(src, name="x")}
    ready = g(dlpack._import_exact(torch.zeros(16, dtype=torch.int32, device=interop_setup.DEV), name="r"))
    jax.block_until_ready(ready)

    def donate_step():
        holder["x"] = g(holder["x"])

    def donate_ptr():
        holder["x"] = g(holder["x"])
        holder["x"].unsafe_buffer_pointer()

    def donate_export():
        holder["x"] = g(holder["x"])
        dlpack.to_torch(holder["x"])

    steps = {
        "fence import: jax.dlpack.from_dlpack(torch, copy=False) (fresh, no pointer check)": lambda: (
            jax.dlpack.from_dlpack(t, copy=False)
        ),
        "fresh import + unsafe_buffer_pointer (interop.dlpack._import_exact)": lambda: dlpack._import_exact(
            t, name="fence"
        ),
        "donating jit dispatch on an imported buffer": donate_step,
        "donating jit dispatch + unsafe_buffer_pointer of its pending output": donate_ptr,
        "donating jit dispatch + torch.from_dlpack of its pending output": donate_export,
        "torch.from_dlpack(ready jax array)": lambda: dlpack.to_torch(ready),
        "torch.cuda.Event record (for scale)": (lambda: torch.cuda.Event().record())
        if interop_setup.DEV == "cuda"
        else (lambda: None),
    }
    prof = {}
    for name, fn in steps.items():
        prof[name] = interop_setup.timeit(fn, n=200, lat_n=20, block=lambda: jax.block_until_ready(holder["x"]))
        log(f"overhead step: {name}: us/call {prof[name][0]}, latency {prof[name][1]}")
    results.append(dict(overhead_steps={k: {"us_per_call": v[0], "latency_us": v[1]} for k, v in prof.items()}))


def write_report(out_dir, probes, results):
    json.dump(dict(probes=probes, results=results), open(os.path.join(out_dir, "interop_gpu.json"), "w"), indent=1)
    lines = [
        "| slots | backend | op | case | entries | torch us/call | JAX us/call (same program) | overhead us | "
        "torch latency us | JAX latency us | aliased (in place, no copy) | copied back | violations |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    extra = []
    for r in results:
        if "torch_us_per_call" in r:
            lines.append(
                f"| {r['slots']} | {r['backend']} | {r['op']} | {r['case']} | {r['entries']} | "
                f"{r['torch_us_per_call']} | {r['jax_us_per_call']} | {r['overhead_us']} | "
                f"{r['torch_latency_us']} | {r['jax_latency_us']} | {', '.join(r['aliased']) or '-'} | "
                f"{', '.join(r['copied_back']) or '-'} | {r['violations_during_timing']} |"
            )
        elif "error" in r:
            lines.append(
                f"| {r['slots']} | {r['backend']} | FAILED ({r.get('case', '')}): "
                f"{r['error'].strip().splitlines()[-1][:120]} |"
            )
        elif "copy_back_canary_buf_us" in r:
            extra.append(
                f"* torch copy_ of a whole {r['slots']}-slot canary buffer (the no-donation fallback): "
                f"{r['copy_back_canary_buf_us']} us"
            )
        elif "overhead_steps" in r:
            extra.append("* handshake steps alone (us/call, latency us): " + json.dumps(r["overhead_steps"]))
        elif "attribution" in r:
            for k, v in r["attribution"].items():
                extra.append(f"* {r['slots']} slots, {r['backend']}, {k}: {json.dumps(v)}")
        elif "canary_jax_api_us_per_call" in r:
            extra.append(
                f"* canary_jax API twin {r['op']} {r['case']} at {r['slots']}: "
                f"{r['canary_jax_api_us_per_call']} us/call, latency {r['canary_jax_api_latency_us']} us"
            )
    md = "\n".join([f"probes: {json.dumps(probes)}", ""] + lines + [""] + extra)
    open(os.path.join(out_dir, "interop_gpu.md"), "w").write(md + "\n")
    return md


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="interop_bench_out")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 24])
    ap.add_argument("--backends", nargs="+", default=["pallas", "reference"])
    ap.add_argument("--cases", nargs="+", default=["tiny", "full"], choices=["tiny", "full"])
    ap.add_argument("--cap", type=int, default=32768)
    ap.add_argument("--deadline-s", type=float, default=0.0, help="start no new case after this many seconds")
    ap.add_argument("--no-attribution", action="store_true")
    ap.add_argument("--no-profile", action="store_true", help="skip overhead_profile")
    ap.add_argument("--api-twin", action="store_true", help="also time canary_jax.verify (compiles more)")
    args = ap.parse_args()
    start = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    log = interop_setup.tee_log(os.path.join(args.out, "interop_gpu_log.txt"), "a")

    dev = torch.device(interop_setup.DEV)
    client = jax.devices()[0].client
    probes = dict(
        torch=torch.__version__,
        jax=jax.__version__,
        gpu=torch.cuda.get_device_name(0) if interop_setup.DEV == "cuda" else "cpu",
        jax_platform_version=str(getattr(client, "platform_version", "?")),
        jax_client=type(client).__name__,
        jax_runtime_type=str(getattr(client, "runtime_type", "?")),
        import_alignment_bytes=dlpack.device_alignment(dev),
        donation_aliases=runner.donation_aliases(dev),
        x64=bool(jax.config.read("jax_enable_x64")),
        compilation_cache=os.environ.get("JAX_COMPILATION_CACHE_DIR", "") != "",
    )
    log(f"probes: {probes}")
    results = []
    if not args.no_profile:
        try:
            overhead_profile(results, log)
        except Exception:  # noqa: BLE001
            log(traceback.format_exc())
        write_report(args.out, probes, results)
    if interop_setup.DEV == "cuda":  # what the fallback would cost: copying a whole canary buffer back, per launch
        for n in args.sizes:
            a = torch.empty(n, 32, dtype=torch.uint8, device=interop_setup.DEV)
            b = torch.empty_like(a)
            thr, _ = interop_setup.timeit(lambda a=a, b=b: a.copy_(b), n=20, lat_n=5)
            results.append(dict(slots=n, copy_back_canary_buf_us=thr))
            log(f"torch copy_ of a {n}-slot canary buffer: {thr} us")
            del a, b
    attributed = args.no_attribution
    for backend in args.backends:  # production backend first: partial runs still give its figures
        for case in args.cases:  # tiny first: the overhead figures
            for n in args.sizes:
                elapsed = time.perf_counter() - start
                if args.deadline_s and elapsed > args.deadline_s:
                    log(f"deadline: skipping N={n} {backend} {case} ({elapsed:.0f}s > {args.deadline_s:.0f}s)")
                    results.append(dict(slots=n, backend=backend, case=case, error="skipped: deadline"))
                    continue
                try:
                    s = interop_setup.Setup(n, args.cap)
                    bench_case(
                        s,
                        backend,
                        case == "tiny",
                        results,
                        log,
                        attribute=not attributed and case == "tiny",
                        api_twin=args.api_twin,
                    )
                    attributed = attributed or case == "tiny"
                except Exception:  # noqa: BLE001 - record and go on
                    log(f"N={n} {backend} {case}: FAILED\n{traceback.format_exc()}")
                    results.append(dict(slots=n, backend=backend, case=case, error=traceback.format_exc()[-2000:]))
                finally:
                    streams.set_stream_sync("fence")
                    runner.set_alias_check("first")
                    s = None
                    interop_setup.sync()
                    if interop_setup.DEV == "cuda":
                        torch.cuda.empty_cache()
                write_report(args.out, probes, results)
    print(write_report(args.out, probes, results))
    log(f"total {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
