"""GPU figures for the torch interop: per-call overhead of torch-launched verify / write versus the same launch
from JAX, and the cost at 1M and 16M slots.

For each pool size N (canary ``uint8 [N, 32]``, one real-KV source = layer-0 K as ``bf16 [N, 64]``, i.e.
128 bytes per slot, PARTIAL mode) and each backend:

* ``verify``: a clean verify plan of C entries (32 requests x C/32 prefix positions, random unique slots,
  previously stamped by the torch write launcher so nothing fires);
* ``write``: 32 requests x 8 new tokens each, seeded on the prefix ends (re-stamping the same slots);
* ``tiny`` variants (C = 64 entries, 1 request x 1 token) expose the fixed per-call cost.

Each is timed (a) torch-launched through ``interop.sglang`` on the torch tensors, (b) JAX-launched through
``canary_jax.verify`` / ``canary_jax.write`` on JAX-owned copies (donating), in two ways: ``us_per_call``
= wall time of 100 back-to-back launches then one device sync (throughput; what a serving loop pays), and
``latency_us`` = median over 30 single launches each followed by a device sync. ``overhead_us`` = torch -
JAX. The report also records what the probes measured (import alignment, whether donation aliases) and
which outputs came back aliased (the torch memory itself) or copied back.

Usage: python3 benchmarks/interop_bench.py --out DIR [--sizes 1048576 16777216] [--backends pallas reference]
Writes DIR/interop_gpu.json and DIR/interop_gpu.md and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import canary_jax as cj  # noqa: E402
from canary_jax import layout as L  # noqa: E402
from canary_jax import plans as P  # noqa: E402
from interop import dlpack as D  # noqa: E402
from interop import inplace as IP  # noqa: E402
from interop import sglang as G  # noqa: E402

DEV = os.environ.get("INTEROP_BENCH_DEVICE", "cuda")
REQS = 32
WRITE_TOKENS = 8


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def timeit(fn, *, n=100, lat_n=30, warm=5, block=None):
    for _ in range(warm):
        fn()
    sync()
    if block:
        block()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    if block:
        block()
    thr = (time.perf_counter() - t0) / n * 1e6
    lat = []
    for _ in range(lat_n):
        t0 = time.perf_counter()
        fn()
        sync()
        if block:
            block()
        lat.append((time.perf_counter() - t0) * 1e6)
    return round(thr, 1), round(statistics.median(lat), 1)


class Setup:
    def __init__(self, n_slots: int, cap: int, seed: int = 0):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.n = n_slots
        self.buf = torch.zeros(n_slots, 32, dtype=torch.uint8, device=DEV)
        self.k0 = torch.randn(n_slots, 64, generator=g, device=DEV).to(torch.bfloat16)
        self.state = G.CanaryDeviceState.allocate(ring_capacity=1024, device=DEV)
        self.src = G.RealKvSource(tensor=self.k0, page_size=1, num_bytes_per_token=128, read_bytes=128)
        self.ctx = self.state.context(canary_buf=self.buf, kernel_kind=G.CanaryLaunchTag.TAIL_K_FULL,
                                      real_kv_sources=(self.src,), real_kv_hash_mode=G.RealKvHashMode.PARTIAL)
        per = cap // REQS
        perm = torch.randperm(n_slots - 1, generator=g, device=DEV)[: cap + REQS * WRITE_TOKENS] + 1
        self.prefix_slots = perm[:cap].reshape(REQS, per)
        self.new_slots = perm[cap:].reshape(REQS, WRITE_TOKENS)
        self.per = per
        self.cap = cap

    def stamp_prefix(self, backend):
        """One big write of every prefix (so the verify plan is clean)."""
        wp = G.WritePlan.allocate(write_req_capacity=REQS, device=DEV)
        wp.write_offsets.copy_(torch.arange(REQS + 1, device=DEV) * self.per)
        wp.write_seed_slot_indices.fill_(-1)
        wp.write_num_valid_reqs.fill_(REQS)
        t = REQS * self.per
        ids = torch.randint(0, 50000, (t,), device=DEV)
        pos = torch.arange(self.per, device=DEV).repeat(REQS)
        G.launch_canary_write_kernel(context=self.ctx, plan=wp, input_ids=ids, positions=pos,
                                     out_cache_loc=self.prefix_slots.reshape(-1).contiguous(),
                                     enable_write_input_assert=False, expected_input_tokens=None,
                                     expected_input_positions=None, backend=backend)
        sync()

    def verify_plan(self, tiny=False):
        """Clean entries: tiny = the first 64 positions of request 0, full = every prefix position."""
        if tiny:
            k = min(64, self.per)
            slots = self.prefix_slots[0, :k]
            prev = torch.cat([torch.tensor([-1], device=DEV), slots[:-1]])
            pos = torch.arange(k, device=DEV)
        else:
            slots = self.prefix_slots.reshape(-1)
            prev = torch.cat([torch.full((REQS, 1), -1, device=DEV, dtype=torch.int64),
                              self.prefix_slots[:, :-1]], 1).reshape(-1)
            pos = torch.arange(self.per, device=DEV).repeat(REQS)
        vp = G.VerifyPlan.allocate(verify_capacity=slots.shape[0], device=DEV)
        vp.verify_slot_indices.copy_(slots)
        vp.verify_prev_slot_indices.copy_(prev)
        vp.verify_expected_positions.copy_(pos)
        vp.verify_expected_tokens.fill_(-1)
        vp.verify_num_valid.fill_(slots.shape[0])
        vp.enable.fill_(1)
        return vp

    def write_args(self, tiny=False):
        reqs, tok = (1, 1) if tiny else (REQS, WRITE_TOKENS)
        wp = G.WritePlan.allocate(write_req_capacity=reqs, device=DEV)
        wp.write_offsets.copy_(torch.arange(reqs + 1, device=DEV) * tok)
        wp.write_seed_slot_indices.copy_(self.prefix_slots[:reqs, -1])
        wp.write_num_valid_reqs.fill_(reqs)
        kw = dict(input_ids=torch.randint(0, 50000, (reqs * tok,), device=DEV),
                  positions=(torch.arange(tok, device=DEV) + self.per).repeat(reqs),
                  out_cache_loc=self.new_slots[:reqs, :tok].reshape(-1).contiguous(),
                  enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None)
        return wp, kw

    # --- JAX-owned twins ---------------------------------------------------------------------------------
    def jax_context(self):
        buf = jnp.array(D.to_jax(self.buf, name="buf"))  # a JAX-owned copy
        src = cj.RealKvSource(tensor=jnp.array(D.to_jax(self.k0.view(torch.uint8), name="k0")), page_size=1,
                              num_bytes_per_token=128, read_bytes=128)
        log = L.ViolationLog.allocate(ring_capacity=1024)
        return cj.VerifyOrWriteContext(canary_buf=buf, kernel_kind=cj.CanaryLaunchTag.TAIL_K_FULL, log=log,
                                       real_kv_sources=(src,), real_kv_hash_mode=cj.RealKvHashMode.PARTIAL)


def jax_pairs(t):
    return jax.lax.bitcast_convert_type(jnp.array(D.to_jax(t, name="t")), jnp.uint32)


def jax_verify_plan(vp):
    return P.VerifyPlan(verify_slot_indices=jax_pairs(vp.verify_slot_indices),
                        verify_expected_tokens=jax_pairs(vp.verify_expected_tokens),
                        verify_expected_positions=jax_pairs(vp.verify_expected_positions),
                        verify_prev_slot_indices=jax_pairs(vp.verify_prev_slot_indices),
                        verify_num_valid=jnp.array(D.to_jax(vp.verify_num_valid, name="nv")),
                        enable=jnp.array(D.to_jax(vp.enable, name="en")))


def jax_write_plan(wp):
    return P.WritePlan(write_offsets=jax_pairs(wp.write_offsets),
                       write_seed_slot_indices=jax_pairs(wp.write_seed_slot_indices),
                       write_num_valid_reqs=jnp.array(D.to_jax(wp.write_num_valid_reqs, name="nvr")))


def bench_size(n_slots, cap, backends, results, log):
    s = Setup(n_slots, cap)
    for backend in backends:
        try:
            t0 = time.perf_counter()
            s.stamp_prefix(backend)
            log(f"N={n_slots} {backend}: stamped {cap} prefix slots in {time.perf_counter() - t0:.1f}s (incl. compile)")
            for tiny in (True, False):
                case = "tiny" if tiny else "full"
                vp = s.verify_plan(tiny)
                wp, wkw = s.write_args(tiny)
                before = int(s.state.violation_write_index.item())

                def tv():
                    G.launch_canary_verify_kernel(context=s.ctx, plan=vp, check_verify_expected_token=False,
                                                  backend=backend)

                def tw():
                    G.launch_canary_write_kernel(context=s.ctx, plan=wp, backend=backend, **wkw)

                t0 = time.perf_counter()
                tv(), tw()
                sync()
                log(f"  {case}: first torch launches (compile) {time.perf_counter() - t0:.1f}s")
                v_thr, v_lat = timeit(tv)
                v_rep = IP.last_launch_report()
                w_thr, w_lat = timeit(tw)
                w_rep = IP.last_launch_report()
                viol = int(s.state.violation_write_index.item()) - before
                # JAX-launched twins
                jctx = s.jax_context()
                jvp, jwp = jax_verify_plan(vp), jax_write_plan(wp)
                jw = {k: jax_pairs(v) for k, v in wkw.items() if isinstance(v, torch.Tensor)}
                holder = {"ctx": jctx}

                def jv():
                    holder["ctx"] = cj.verify(holder["ctx"], jvp, check_verify_expected_token=False, backend=backend)

                def jwf():
                    holder["ctx"] = cj.write(holder["ctx"], jwp, jw["input_ids"], jw["positions"],
                                             jw["out_cache_loc"], backend=backend)

                blk = lambda: jax.block_until_ready(holder["ctx"].log.write_index)  # noqa: E731
                t0 = time.perf_counter()
                jv(), jwf()
                blk()
                log(f"  {case}: first JAX launches (compile) {time.perf_counter() - t0:.1f}s")
                jv_thr, jv_lat = timeit(jv, block=blk)
                jw_thr, jw_lat = timeit(jwf, block=blk)
                for op, thr, lat, jthr, jlat, rep in (("verify", v_thr, v_lat, jv_thr, jv_lat, v_rep),
                                                     ("write", w_thr, w_lat, jw_thr, jw_lat, w_rep)):
                    row = dict(slots=n_slots, backend=backend, op=op, case=case,
                               entries=vp.verify_slot_indices.shape[0] if op == "verify" else wkw["input_ids"].shape[0],
                               torch_us_per_call=thr, jax_us_per_call=jthr, overhead_us=round(thr - jthr, 1),
                               torch_latency_us=lat, jax_latency_us=jlat, aliased=rep["aliased"],
                               copied_back=rep["copied_back"], violations_during_timing=viol)
                    results.append(row)
                    log("  " + json.dumps(row))
                del jctx, holder
        except Exception:  # noqa: BLE001 - record and go on with the next backend
            log(f"N={n_slots} {backend}: FAILED\n{traceback.format_exc()}")
            results.append(dict(slots=n_slots, backend=backend, error=traceback.format_exc()[-2000:]))
    del s
    sync()
    torch.cuda.empty_cache()


def overhead_profile(results, log):
    """Where a torch launch's per-call cost goes: each handshake step timed alone (no canary compile)."""
    t = torch.zeros(64, dtype=torch.uint8, device=DEV)
    a = jnp.zeros((16,), jnp.int32) + 1
    f = jax.jit(lambda x: x + 1)
    g = jax.jit(lambda x: x + 1, donate_argnums=0)
    holder = {"x": D.to_jax(torch.zeros(16, dtype=torch.int32, device=DEV), name="x")}

    def donate_step():
        holder["x"] = g(holder["x"])

    steps = {
        "fresh DLPack import of a torch tensor (fence)": lambda: D._import_exact(t, name="fence"),
        "torch.from_dlpack(jax array) (stream wait)": lambda: D.to_torch(a),
        "jit dispatch, 1 arg": lambda: f(a),
        "jit dispatch + unsafe_buffer_pointer of the pending output": lambda: f(a).unsafe_buffer_pointer(),
        "donating jit dispatch on an imported buffer": donate_step,
        "torch.cuda.Event record (for scale)": (lambda: torch.cuda.Event().record()) if DEV == "cuda" else (lambda: None),
    }
    prof = {}
    for name, fn in steps.items():
        prof[name] = timeit(fn, n=200, lat_n=20)
        log(f"overhead step: {name}: us/call {prof[name][0]}, latency {prof[name][1]}")
    results.append(dict(overhead_steps={k: {"us_per_call": v[0], "latency_us": v[1]} for k, v in prof.items()}))


def sync_mode_figure(results, log):
    """fence (default, asynchronous) versus host synchronisation, tiny verify, reference backend."""
    s = Setup(1 << 20 if DEV == "cuda" else 4096, 64 * REQS)
    s.stamp_prefix("reference")
    vp = s.verify_plan(True)
    out = {}
    for mode in ("fence", "host", "none"):
        IP.set_stream_sync(mode)

        def tv():
            G.launch_canary_verify_kernel(context=s.ctx, plan=vp, check_verify_expected_token=False,
                                          backend="reference")

        out[mode] = timeit(tv)
    IP.set_stream_sync("fence")
    results.append(dict(op="verify", case="tiny", sync_modes={k: {"us_per_call": v[0], "latency_us": v[1]}
                                                              for k, v in out.items()}))
    log(f"sync modes (tiny verify, reference): {out}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 24])
    ap.add_argument("--backends", nargs="+", default=["pallas", "reference"])
    ap.add_argument("--cap", type=int, default=32768)
    ap.add_argument("--sync-modes-first", action="store_true", help="time fence/host/none before the sizes")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "interop_gpu_log.txt"), "a")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    dev = torch.device(DEV)
    probes = dict(torch=torch.__version__, jax=jax.__version__,
                  gpu=torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu",
                  import_alignment_bytes=D.device_alignment(dev), donation_aliases=IP.donation_aliases(dev),
                  x64=bool(jax.config.read("jax_enable_x64")))
    log(f"probes: {probes}")
    results = []
    try:
        overhead_profile(results, log)
    except Exception:  # noqa: BLE001
        log(traceback.format_exc())
    if DEV == "cuda":  # what the fallback would cost: copying a whole canary buffer back, per launch
        for n in args.sizes:
            a = torch.empty(n, 32, dtype=torch.uint8, device=DEV)
            b = torch.empty_like(a)
            thr, _ = timeit(lambda: a.copy_(b), n=20, lat_n=5)
            results.append(dict(slots=n, copy_back_canary_buf_us=thr))
            log(f"torch copy_ of a {n}-slot canary buffer: {thr} us")
            del a, b
    if args.sync_modes_first:
        try:
            sync_mode_figure(results, log)
        except Exception:  # noqa: BLE001
            log(traceback.format_exc())
    for backend in args.backends:  # production backend first: partial runs still give its figures
        for n in args.sizes:
            bench_size(n, args.cap, [backend], results, log)
            json.dump(dict(probes=probes, results=results), open(os.path.join(args.out, "interop_gpu.json"), "w"),
                      indent=1)
    if not args.sync_modes_first:
        try:
            sync_mode_figure(results, log)
        except Exception:  # noqa: BLE001
            log(traceback.format_exc())
    json.dump(dict(probes=probes, results=results), open(os.path.join(args.out, "interop_gpu.json"), "w"), indent=1)
    lines = ["| slots | backend | op | case | entries | torch us/call | JAX us/call | overhead us | torch latency us | "
             "JAX latency us | aliased (in place, no copy) | copied back |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "torch_us_per_call" in r:
            lines.append(f"| {r['slots']} | {r['backend']} | {r['op']} | {r['case']} | {r['entries']} | "
                         f"{r['torch_us_per_call']} | {r['jax_us_per_call']} | {r['overhead_us']} | "
                         f"{r['torch_latency_us']} | {r['jax_latency_us']} | {', '.join(r['aliased'])} | "
                         f"{', '.join(r['copied_back']) or '-'} |")
        elif "error" in r:
            lines.append(f"| {r['slots']} | {r['backend']} | FAILED: {r['error'].strip().splitlines()[-1][:120]} |")
        elif "copy_back_canary_buf_us" in r:
            lines.append(f"| {r['slots']} | - | torch copy_ of the whole canary buffer (the no-donation fallback) | "
                         f"{r['copy_back_canary_buf_us']} us |")
        elif "overhead_steps" in r:
            lines.append("\nper-call handshake steps (us/call, latency us): " + json.dumps(r["overhead_steps"]))
        elif "sync_modes" in r:
            lines.append(f"\nsync modes (tiny verify, reference, 1M slots): {json.dumps(r['sync_modes'])}")
    md = "\n".join([f"probes: {json.dumps(probes)}", ""] + lines)
    open(os.path.join(args.out, "interop_gpu.md"), "w").write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
