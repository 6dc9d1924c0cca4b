"""The report: the canary's split of a scenario's step (device ms per part, wall delta to ``off``) and the
Markdown tables of a run."""

from __future__ import annotations

from benchmarks.serving_step.shapes import HEAD_TAIL_TARGET_MS, TARGETS, WRITE_TARGET_US


def canary_split(res: dict) -> dict:
    """Per canary mode: the device time per step of each part from the step's profile, HEAD+TAIL (plan, HEAD,
    TAIL; no sweep), the sweep amortised, and the wall-time difference to ``off``."""
    out = {}
    off = res["modes"].get("off", {})
    off_prof = off.get("profile", {}).get("parts_ms", {})
    for x, mr in res["modes"].items():
        if x == "off":
            continue
        prof = mr.get("profile", {}).get("parts_ms")
        rec = {}
        if "step_ms" in mr and "step_ms" in off:
            rec["wall_delta_ms"] = mr["step_ms"] - off["step_ms"]
            rec["wall_delta_pct_of_roofline"] = 100 * rec["wall_delta_ms"] / res["roofline"]["ms"]
        if prof:
            canary = {k: v for k, v in prof.items() if k not in ("model", "other", "memcpy")}
            rec["parts_ms"] = canary
            rec["head_tail_ms"] = sum(v for k, v in canary.items() if not k.startswith("sweep"))
            rec["head_tail_no_plan_ms"] = sum(
                v for k, v in canary.items() if k.startswith(("head", "tail")) and not k.endswith("_copy")
            )
            rec["copies_ms"] = sum(v for k, v in canary.items() if k.endswith("_copy"))
            rec["sweep_ms_amortised"] = sum(v for k, v in canary.items() if k.startswith("sweep"))
            rec["canary_launches_per_step"] = sum(
                v for k, v in mr["profile"].get("launches_per_step", {}).items() if k in canary
            )
            rec["model_ms"] = prof.get("model", 0.0)
            rec["model_delta_vs_off_ms"] = prof.get("model", 0.0) - off_prof.get("model", 0.0)
            rec["other_ms"] = prof.get("other", 0.0) + prof.get("memcpy", 0.0)
            rec["other_delta_vs_off_ms"] = rec["other_ms"] - off_prof.get("other", 0.0) - off_prof.get("memcpy", 0.0)
        out[x] = rec
    return out


def f(x, fmt="{:.3f}"):
    return "-" if x is None else fmt.format(x)


def tables(out: dict) -> str:
    lines = ["## Step time per scenario and mode", ""]
    lines.append(
        "| scenario | mode | step ms | vs off | roofline ms | kernel sum ms | canary device ms/step (HEAD+TAIL / "
        "sweep) | violations clean | fault detected | target |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for name, sres in out.get("scenarios", {}).items():
        if sres.get("error"):
            lines.append(f"| {name} | error: {sres['error'][:80]} |||||||||")
        if "modes" not in sres:
            continue
        roof = sres["roofline"]["ms"]
        for x, mr in sres["modes"].items():
            prof = mr.get("profile", {})
            split = sres.get("canary_split", {}).get(x, {})
            ov = sres.get("overhead_pct", {}).get(x)
            fc = sres.get("fault_check", {}).get(x)
            tgt = "-"
            if x == "partial" and name in TARGETS and ov is not None:
                tgt = f"<= {TARGETS[name]} %: {'met' if ov <= TARGETS[name] else 'MISSED'}"
            if name == "decode128" and x in HEAD_TAIL_TARGET_MS and split.get("head_tail_ms") is not None:
                ht = HEAD_TAIL_TARGET_MS[x]
                tgt += f"; HEAD+TAIL <= {ht} ms: {'met' if split['head_tail_ms'] <= ht else 'MISSED'}"
            lines.append(
                "| "
                + " | ".join(
                    [
                        name,
                        x,
                        f(mr.get("step_ms")),
                        "-" if ov is None else f"{ov:+.2f} %",
                        f(roof),
                        f(prof.get("kernel_sum_ms")),
                        "-"
                        if not split.get("parts_ms")
                        else f"{split['head_tail_ms']:.3f} / {split['sweep_ms_amortised']:.3f}",
                        str(mr.get("violations_clean", "-")),
                        "-" if not fc else f"{fc['detected']} ({fc['new_violations']} rows)",
                        tgt,
                    ]
                )
                + " |"
            )
    lines += ["", "## Canary parts per step (device ms, from the step's profile; sweep amortised)", ""]
    cols = [
        "plan",
        "plan_copy",
        "head_verify",
        "head_write",
        "head_phase",
        "head_copy",
        "tail_verify",
        "tail_write",
        "tail_phase",
        "tail_copy",
        "sweep_plan",
        "sweep_verify",
        "sweep_copy",
    ]
    lines.append(
        "| scenario | mode | "
        + " | ".join(cols)
        + " | plan+HEAD+TAIL | launches | other vs off | wall delta vs off | delta / roofline |"
    )
    lines.append("|---|---|" + "---|" * (len(cols) + 5))
    for name, sres in out.get("scenarios", {}).items():
        for x, split in sres.get("canary_split", {}).items():
            p = split.get("parts_ms", {})
            lines.append(
                f"| {name} | {x} | "
                + " | ".join(f(p.get(c)) for c in cols)
                + f" | {f(split.get('head_tail_ms'))} | {f(split.get('canary_launches_per_step'), '{:.1f}')}"
                + f" | {f(split.get('other_delta_vs_off_ms'))} | {f(split.get('wall_delta_ms'))}"
                + f" | {f(split.get('wall_delta_pct_of_roofline'), '{:.2f} %')} |"
            )
    lines += ["", "## Parts as their own jitted programs (us per launch: wall / kernel sum)", ""]
    lines.append("| scenario | part | us (wall) | us (kernel sum) | compile s | top kernels |")
    lines.append("|---|---|---|---|---|---|")
    for name, sres in out.get("scenarios", {}).items():
        for part, rec in sres.get("parts_jit", {}).items():
            ks = "; ".join(f"{k['kernel'][:40]} {k['us']:.1f}" for k in rec.get("kernels", [])[:4])
            lines.append(
                f"| {name} | {part} | {f(rec.get('us'), '{:.1f}')} | {f(rec.get('kernel_sum_us'), '{:.1f}')} | "
                f"{rec.get('compile_s', '-')} | {ks or rec.get('error', '-')} |"
            )
    wb = out.get("write4096")
    if wb:
        lines += [
            "",
            f"Decode write {wb.get('requests')} x 1 token, NONE: {f(wb.get('us'), '{:.2f}')} us "
            f"(target <= {WRITE_TARGET_US} us: {'met' if wb.get('us', 1e9) <= WRITE_TARGET_US else 'MISSED'}); "
            f"kernel sum {f(wb.get('kernel_sum_us'), '{:.2f}')} us: "
            + "; ".join(f"{k['kernel'][:40]} {k['us']:.2f} x{k['launches']:.0f}" for k in wb.get("kernels", [])[:8]),
        ]
    return "\n".join(lines)
