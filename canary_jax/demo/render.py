"""Text tables and the PNG chart of a campaign summary (see :func:`canary_jax.demo.campaign.summarize`)."""

from __future__ import annotations

import os
import sys
from typing import Sequence, TextIO


def _short_reasons(reasons: dict, limit: int = 4) -> str:
    if not reasons:
        return "-"
    items = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    parts = [k.replace("_K_FULL", "").replace("_FULL", "") for k, _ in items[:limit]]
    more = len(items) - limit
    return ", ".join(parts) + (f", +{more} more" if more > 0 else "")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, title: str | None = None) -> str:
    """A plain monospace table."""
    cols = list(zip(*([headers] + [list(map(str, r)) for r in rows]))) if rows else [[h] for h in headers]
    widths = [max(len(str(c)) for c in col) for col in cols]
    sep = "+".join("-" * (w + 2) for w in widths)
    line = lambda cells: "|".join(f" {str(c):<{w}} " for c, w in zip(cells, widths))  # noqa: E731
    out = []
    if title:
        out.append(title)
    out += [line(headers), sep] + [line(r) for r in rows]
    return "\n".join(out)


def fault_rows(summary: dict) -> list[list[str]]:
    rows = []
    for f in summary["faults"]:
        lat = f["steps_to_detect"]
        lat_s = "-" if not lat else (f"{f['mean_steps_to_detect']:g} (max {f['max_steps_to_detect']})"
                                     if len(lat) > 1 else str(lat[0]))
        rows.append([f["kind"], f["caught_by"], str(f["injected"]), str(f["detected"]), lat_s,
                     _short_reasons(f["fail_reasons"]), f["verdict"]])
    return rows


FAULT_HEADERS = ["fault kind", "should be caught by", "injected", "detected", "steps to detect",
                 "fail reasons fired (launch:reason)", "verdict"]


def timing_rows(summary: dict) -> list[list[str]]:
    t = summary["timing"]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    return [
        ["model forward (per step)", fmt(t["model_ms_per_step_median"]), fmt(t["model_ms_per_step_mean"])],
        ["canary HEAD+TAIL incl. plan (per step)", fmt(t["canary_ms_per_step_median"]),
         fmt(t["canary_ms_per_step_mean"])],
        [f"canary SWEEP (per pass, {t['sweep_passes']} passes)", fmt(t["sweep_ms_per_pass_median"]), "-"],
        ["canary SWEEP amortized (per step)", "-", fmt(t["sweep_ms_per_step_amortized"])],
    ]


def render_text(summary: dict, *, out: TextIO | None = None) -> None:
    """Prints the report (rich tables when rich is installed and ``out`` is a terminal, plain text otherwise).

    ``out`` defaults to the *current* ``sys.stdout`` (looked up per call, not bound at import time).
    """
    out = sys.stdout if out is None else out
    c = summary["canary"]
    t = summary["timing"]
    w = summary["workload"]
    head = (f"canary: real-KV hash {c['real_kv_hash_mode']}, sweep every {c['sweep_interval']} steps, "
            f"token oracle {'on' if c['token_oracle'] else 'off'}; backend {t['backend']} on {t['device']}\n"
            f"workload: {w['num_requests']} requests x {w['max_new_tokens']} new tokens, "
            f"{w['prefix_hit_tokens']}/{w['prompt_tokens']} prompt tokens from the prefix cache, "
            f"{w['pages_allocated']} page allocations from a {summary['engine']['num_pages'] - 1}-page pool, "
            f"{w['pages_evicted']} pages evicted from the prefix cache (clean phase)")
    fp_line = (f"false positives (clean phase + before injections): {summary['false_positives']}"
               + ("" if not summary["false_positives"] else f"  {summary['false_positive_reasons']}"))
    overhead = t["canary_overhead_pct"]
    if t["device"].startswith("cpu"):
        where = ("CPU figures: jnp reference kernels on the CPU" if t["backend"] == "reference"
                 else "CPU figures: Pallas kernels in interpret mode on the CPU")
    else:
        where = f"{t['device']}, {t['backend']} kernels"
    timing_title = f"time per step, ms ({t['clean_steps']} clean steps, compile excluded; {where})"
    notes = [f"- {f['kind']}: {f['expected_miss_reason']} -> a miss is expected in this configuration"
             for f in summary["faults"] if not f["expected_detect"]]
    verdict = "OK: every fault the configuration should catch was caught, no false positives" if summary["ok"] \
        else "FAIL: " + "; ".join(
            [f"{f['kind']} {f['verdict']}" for f in summary["faults"] if not f["ok"]]
            + ([f"{summary['false_positives']} false positives"] if summary["false_positives"] else [])
            + [f"health check: {e}" for e in summary.get("health_errors", [])])
    use_rich = False
    if hasattr(out, "isatty") and out.isatty() and not os.environ.get("NO_COLOR"):
        try:
            import rich  # noqa: F401

            use_rich = True
        except ImportError:
            pass
    if use_rich:
        from rich.console import Console
        from rich.table import Table

        con = Console(file=out)
        con.print(head)
        tab = Table(title="fault campaign")
        for h in FAULT_HEADERS:
            tab.add_column(h, overflow="fold")
        for r in fault_rows(summary):
            style = "green" if r[-1] == "ok" else ("yellow" if r[-1].startswith(("expected", "ok")) else "red")
            tab.add_row(*r, style=style)
        con.print(tab)
        con.print(fp_line, style="green" if not summary["false_positives"] else "red")
        tt = Table(title=timing_title)
        for h in ("part", "median", "mean"):
            tt.add_column(h)
        for r in timing_rows(summary):
            tt.add_row(*r)
        con.print(tt)
        con.print(f"canary overhead vs model: {overhead}% (mean, sweep amortized)")
        for n in notes:
            con.print(n, style="yellow")
        con.print(verdict, style="bold green" if summary["ok"] else "bold red")
        return
    print(head, file=out)
    print(file=out)
    print(table(FAULT_HEADERS, fault_rows(summary), title="fault campaign"), file=out)
    print(file=out)
    print(fp_line, file=out)
    print(file=out)
    print(table(["part", "median", "mean"], timing_rows(summary), title=timing_title), file=out)
    print(f"canary overhead vs model: {overhead}% (mean, sweep amortized)", file=out)
    for n in notes:
        print(n, file=out)
    print(verdict, file=out)


def plot(summary: dict, path: str) -> None:
    """Bar chart: injected vs detected per fault kind, and steps until detection."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    faults = summary["faults"]
    kinds = [f["kind"] for f in faults]
    inj = [f["injected"] for f in faults]
    det = [f["detected"] for f in faults]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.3 * len(kinds) + 4), 4.5))
    x = range(len(kinds))
    ax1.bar([i - 0.2 for i in x], inj, width=0.4, label="injected", color="#9aa5b1")
    colors = ["#2e7d32" if f["ok"] and f["expected_detect"] else ("#f9a825" if f["ok"] else "#c62828")
              for f in faults]
    ax1.bar([i + 0.2 for i in x], det, width=0.4, label="detected", color=colors)
    ax1.set_xticks(list(x), kinds, rotation=35, ha="right")
    ax1.set_ylabel("trials")
    ax1.set_ylim(0, max(inj + [1]) * 1.3)
    ax1.yaxis.get_major_locator().set_params(integer=True)
    ax1.set_title(f"detection per fault kind (real-KV {summary['canary']['real_kv_hash_mode']}), "
                  f"false positives: {summary['false_positives']}", fontsize=9)
    ax1.legend(loc="upper right", ncol=2, fontsize=8)
    lat = [f["mean_steps_to_detect"] if f["mean_steps_to_detect"] is not None else 0 for f in faults]
    ax2.bar(list(x), lat, color="#1565c0")
    ax2.set_xticks(list(x), kinds, rotation=35, ha="right")
    ax2.set_ylabel("steps from injection to first violation (mean)")
    ax2.set_title("detection latency", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render_violation_samples(summary: dict, *, out: TextIO | None = None) -> None:
    """Prints the first violation of every episode in SGLang's report text (``out`` defaults to sys.stdout)."""
    out = sys.stdout if out is None else out
    for f in summary["faults"]:
        for ep in f["episodes"]:
            if ep.get("first_violation_text"):
                print(f"--- {f['kind']} trial {ep['trial']}: injected at step {ep['inject_step']} "
                      f"{ep['details']}, first violation at step {ep['detect_step']}", file=out)
                print(ep["first_violation_text"], file=out)
