"""The verify sweep's report (``benchmarks.sweep_verify``): the markdown table of the records, the best variant
per mode, the markdown page and the Nsight Compute command for ``--single``.
"""

from __future__ import annotations

import json


def _f(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


def table(records: list[dict]) -> str:
    base = {r["mode"]: r.get("us_per_call") for r in records if r["variant"] == "default"}
    lines = [
        "| mode | variant | us/call | GB/s | % HBM | default/this | first call s | loop compile s | regs | "
        "spill st/ld B | stack B | occ (limit) | ld.global v2/v4/all | shared st/ld, bar | equal clean/corrupt "
        "| note |",
        "|" + "---|" * 16,
    ]
    for r in records:
        k = (r.get("ptx") or {}).get("canary_verify", {})
        b = base.get(r["mode"])
        us = r.get("us_per_call")
        eq = f"{r.get('equal_clean', '-')}/{r.get('equal_corrupt', '-')}"
        note = r.get("error") or r.get("skipped") or (r.get("ptx") or {}).get("error") or k.get("ptxas_error") or ""
        lines.append(
            "| "
            + " | ".join(
                [
                    r["mode"],
                    r["variant"],
                    _f(us),
                    _f(r.get("gb_s"), "{:.0f}"),
                    _f(r.get("hbm_pct")),
                    _f(b / us if b and us else None, "{:.2f}x"),
                    _f(r.get("first_call_s")),
                    _f(r.get("loop_compile_s")),
                    _f(k.get("registers"), "{}"),
                    f"{k['spill_store_bytes']}/{k['spill_load_bytes']}" if "spill_store_bytes" in k else "-",
                    _f(k.get("stack_bytes"), "{}"),
                    f"{k['occupancy']:.2f} ({k['limit']})" if "occupancy" in k else "-",
                    f"{k['ld_global_v2']}/{k['ld_global_v4']}/{k['ld_global']}" if "ld_global" in k else "-",
                    f"{k['st_shared']}/{k['ld_shared']}, {k['bar_sync']}" if "st_shared" in k else "-",
                    eq,
                    note.replace("|", "/").replace("\n", " ")[:120],
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def best_of(records: list[dict]) -> dict:
    out = {}
    for r in records:
        if r.get("us_per_call") is None or r.get("equal_clean") is False or r.get("equal_corrupt") is False:
            continue
        if r["mode"] not in out or r["us_per_call"] < out[r["mode"]]["us_per_call"]:
            out[r["mode"]] = {"variant": r["variant"], "us_per_call": r["us_per_call"], "overrides": r["overrides"]}
    return out


NCU_SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "MemoryWorkloadAnalysis")


def ncu_command(variant: str, out: str = "$OUT") -> str:
    rep = f"{out}/ncu_{variant}"
    sec = " ".join(f"--section {s}" for s in NCU_SECTIONS)
    return (
        f"ncu --target-processes all --kernel-name regex:'^canary_verify$' --launch-skip 1 --launch-count 1 "
        f"--clock-control none {sec} --export {rep} --force-overwrite "
        f"python -m benchmarks.sweep_verify --single {variant} --launches 3 --populate none --out {out}/single "
        f"&& ncu --import {rep}.ncu-rep --page details > {rep}.txt"
    )


def markdown(env: dict, a, total_s: float, tab: str, best: dict) -> list[str]:
    """The lines of ``OUT/sweep_verify.md``: the environment, the run's sizes and total time, the table, the best."""
    return [
        f"# Pallas verify config sweep ({env['date']})",
        "",
        "```",
        json.dumps(env, indent=1),
        "```",
        "",
        f"pool {a.pool}, entries {a.entries}, n {a.n}, reps {a.reps}, budget {a.budget_s:.0f}s; total "
        f"{total_s:.1f}s. `default/this` > 1 means faster than the default. Registers, "
        "spills, occupancy and PTX counts are for `canary_verify` (ptxas -v on the captured PTX).",
        "",
        tab,
        "",
        "best: " + json.dumps(best),
    ]
