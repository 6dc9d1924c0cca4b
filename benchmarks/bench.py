#!/usr/bin/env python3
"""Times the Pallas verify / write kernels, the jnp references under jit and a CUDA peer, in one process.

Cases (``benchmarks.kernel_cases``; each a frozen dataclass with an id):

* verify: ``--entries`` (default 1M) entries over a ``--pool`` (default 4M) slot pool, random slots in
  request-major chains (1024 tokens per request), sources of 256-byte rows; modes NONE, PARTIAL (1 and 4
  sources), ALL (1 and 4 sources). The canary is populated first so every entry is clean.
* write: one request of 32768 tokens and 4096 requests of 1 token (decode, seeded from already written
  slots); modes NONE, PARTIAL x4, ALL x1, ALL x4.

Every case runs with ``jax_enable_x64`` off, then on (Pallas; the references only with x64 off unless
``--ref-x64-on``). Timing (``benchmarks.harness``): a jitted ``lax.fori_loop`` of ``n`` back-to-back launches
that donates its state (so the canary buffer / log are updated in place, as in serving), median over
repetitions of ``(wall time of the program - wall time of an empty program with the same arguments) / n``
after ``block_until_ready``; the CUDA peer (``benchmarks.cuda_peer``) is timed with CUDA events around ``n``
launches captured in a CUDA graph (plain launches if capture is unavailable). Results (us per call, ns per
entry, GB/s of needed bytes and the fraction of the H200's 4.8 TB/s, ratio to the peer, pass/fail of the
targets) are printed as a table last and written to ``$OUT`` (or ``--out``) as ``bench.json`` and
``bench.md``. Correctness is checked along the way: Pallas vs reference (and vs the peer) state after the
same launches, byte for byte. Figures: ``benchmarks/results/`` (``README.md`` there lists the runs).

Usage (GPU, from the repository root):
``python -m benchmarks.bench [--quick] [--probe {none,mini,full}] [--only IDS] [--out DIR]``.
CPU smoke (interpret mode, no peer): ``python -m benchmarks.bench --pool 4096 --entries 1024 --long-tokens 64
--decode-reqs 8 --only verify_none,write_8x1_none --x64 off --quick --out DIR``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import dataclasses
import json
import time
import traceback

import jax

from benchmarks import harness, kernel_cases
from pallas_kernels.config import PallasConfig


# --- report ------------------------------------------------------------------------------------------------
def summarize(results, args) -> tuple[list[dict], str]:
    """One row per timed case (us, ns/entry, GB/s, fraction of HBM, peer ratio, x64 off/on, targets) and the
    markdown table of them."""
    rows = []
    for cid, rec in results.items():
        if not isinstance(rec, dict) or "case" not in rec or cid.startswith("probe:"):
            continue
        row = {"id": cid}
        peer_us = rec.get("peer", {}).get("us_per_call")
        for impl in ("pallas_x64_off", "pallas_x64_on", "reference_x64_off"):
            if impl in rec:
                us = rec[impl]["us_per_call"]
                row[impl + "_us"] = us
                if impl.startswith("pallas"):
                    row[impl + "_ns_per_entry"] = 1e3 * us / rec["entries"]
                    row[impl + "_gb_s"] = rec["needed_bytes"] / (us * 1e-6) / 1e9 if us > 0 else float("inf")
                    row[impl + "_hbm_frac"] = row[impl + "_gb_s"] * 1e9 / harness.HBM_BYTES_PER_S
        row["peer_us"] = peer_us
        p = row.get("pallas_x64_off_us")
        if peer_us and p:
            row["speedup_vs_peer"] = peer_us / p
        if p and row.get("pallas_x64_on_us"):
            row["x64_off_over_on"] = p / row["pallas_x64_on_us"]
        row["equal_to_reference"] = rec.get("equal_to_reference_x64_off")
        row["peer_buffer_equal"] = rec.get("peer_buffer_equal")
        row["targets"] = targets(cid, row)
        rows.append(row)
    lines = [
        "| case | pallas us (x64 off) | x64 on us | off/on | ns/entry | GB/s needed | % of 4.8 TB/s | "
        "reference us | peer us | peer / pallas | equal ref | targets |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    for r in rows:
        lines.append(
            "| "
            + " | ".join(
                [
                    r["id"],
                    f(r.get("pallas_x64_off_us")),
                    f(r.get("pallas_x64_on_us")),
                    f(r.get("x64_off_over_on"), "{:.2f}"),
                    f(r.get("pallas_x64_off_ns_per_entry"), "{:.2f}"),
                    f(r.get("pallas_x64_off_gb_s"), "{:.0f}"),
                    f(
                        100 * r["pallas_x64_off_hbm_frac"] if r.get("pallas_x64_off_hbm_frac") is not None else None,
                        "{:.1f}",
                    ),
                    f(r.get("reference_x64_off_us")),
                    f(r.get("peer_us")),
                    f(r.get("speedup_vs_peer"), "{:.2f}x"),
                    str(r.get("equal_to_reference")),
                    r["targets"] or "-",
                ]
            )
            + " |"
        )
    return rows, "\n".join(lines)


def targets(cid: str, row: dict) -> str:
    """PASS / MISS of the issue's targets that apply to case ``cid``."""
    out = []
    p, s = row.get("pallas_x64_off_us"), row.get("speedup_vs_peer")
    if cid in ("verify_none", "verify_partial_x1", "verify_partial_x4") and s is not None:
        out.append(f"peer ratio >= 1.0x: {'PASS' if s >= 1.0 else 'MISS'}")
    if cid == "verify_all_x4":
        if s is not None:
            out.append(f">= 3x peer: {'PASS' if s >= 3 else 'MISS'}")
        if row.get("pallas_x64_off_hbm_frac") is not None:
            out.append(f">= 60% HBM: {'PASS' if row['pallas_x64_off_hbm_frac'] >= 0.6 else 'MISS'}")
    if cid.startswith("write_1x") and (cid.endswith("_none") or cid.endswith("_all_x4")) and p:
        out.append(f"<= 3 ms: {'PASS' if p <= 3000 else 'MISS'}")
    if cid.endswith("x1_all_x4") and p:
        out.append(f"<= 20 us: {'PASS' if p <= 20 else 'MISS'}")
    r = row.get("x64_off_over_on")
    if r is not None:
        out.append(f"off/on <= 1.2: {'PASS' if r <= 1.2 else 'MISS'}")
    return "; ".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="smaller repetition counts")
    ap.add_argument(
        "--probe",
        choices=("none", "mini", "full"),
        default="none",
        help="time knob variants of a few cases after the cases (mini) or instead of them (full)",
    )
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--pool", type=int, default=1 << 22)
    ap.add_argument("--entries", type=int, default=1 << 20)
    ap.add_argument("--long-tokens", type=int, default=32768)
    ap.add_argument("--decode-reqs", type=int, default=4096)
    ap.add_argument("--only", default="", help="comma-separated substrings of case ids")
    ap.add_argument("--x64", choices=("off", "on", "both"), default="both")
    ap.add_argument("--ref-x64-on", action="store_true")
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default="{}", help="JSON PallasConfig overrides for every Pallas launch")
    ap.add_argument(
        "--probe-json",
        default="",
        help='JSON {"verify": [overrides...], "write": [...]}: the probe variants (default: the built-in lists)',
    )
    ap.add_argument("--probe-cases", default="", help="comma-separated case ids the probe runs (default: built-in)")
    a = ap.parse_args()
    base_config = json.loads(a.config)
    probe_variants = json.loads(a.probe_json) if a.probe_json else None
    probe_cases = tuple(a.probe_cases.split(",")) if a.probe_cases else None
    args = harness.args_from_cli(a, n_peer=20, ref_x64_on=a.ref_x64_on, skip_reference=a.skip_reference)
    os.makedirs(a.out, exist_ok=True)
    env = harness.environment()
    print(json.dumps(env), flush=True)
    results: dict = {
        "environment": env,
        "args": dataclasses.asdict(args),
        "config": base_config,
        "probe_variants": probe_variants,
    }
    t_start = time.perf_counter()
    data = harness.Data(args)
    peer = None
    if not a.no_peer and jax.default_backend() == "gpu":
        from benchmarks.cuda_peer import CudaPeer

        try:
            peer = CudaPeer()
            peer._verify.attributes  # noqa: B018 - compile now, not inside the first case
        except Exception as e:  # noqa: BLE001
            results["peer_error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
    x64_modes = {"off": (False,), "on": (True,), "both": (False, True)}[a.x64]

    def dump():
        with open(os.path.join(a.out, "bench.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)

    if a.probe == "full":
        kernel_cases.run_probe(
            data, args, results, mini=False, variants=probe_variants, want=probe_cases, base_config=base_config
        )
    else:
        cfg = PallasConfig(**base_config)
        for case in kernel_cases.cases(args):
            print(f"[{time.perf_counter() - t_start:6.1f}s] {case.id}", flush=True)
            try:
                kernel_cases.run_case(case, data, args, cfg, peer, results, x64_modes)
            except Exception as e:  # noqa: BLE001
                results.setdefault(case.id, {})["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            dump()
    if a.probe == "mini":
        kernel_cases.run_probe(
            data, args, results, mini=True, variants=probe_variants, want=probe_cases, base_config=base_config
        )
    rows, table = summarize(results, args)
    results["summary"] = rows
    dump()
    probe_lines = []
    for k, v in results.items():
        if k.startswith("probe:"):
            us = v.get("pallas_x64_off", {}).get("us_per_call") if isinstance(v, dict) else None
            probe_lines.append(f"{k}: {us if us is None else round(us, 1)} us {v.get('error', '')}")
    md = [f"# canary-jax benchmark ({env['date']})", "", "```", json.dumps(env, indent=1), "```", "", table]
    if probe_lines:
        md += ["", "## knob probe", "", *probe_lines]
    with open(os.path.join(a.out, "bench.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"total {time.perf_counter() - t_start:.1f}s")
    print("\n".join(probe_lines))
    print(table)


if __name__ == "__main__":
    main()
