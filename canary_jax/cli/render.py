"""Text tables and the PNG chart of a campaign summary (see :func:`canary_jax.cli.demo.summary.summarize`),
and the plain :func:`table` that ``verify-dump`` prints its per-reason counts with.

The chart needs matplotlib (the ``demo`` extra), imported only by :func:`plot` / :func:`plot_figure`; the
tables use rich when it is installed and the output is a terminal, plain text otherwise.
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Sequence
from typing import TextIO

WIDTH = 120  # the report's lines stay within this many columns (SGLang's violation texts excepted)


def _short_reasons(reasons: dict, limit: int | None = 4) -> str:
    if not reasons:
        return "-"
    items = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    shown = items if limit is None else items[:limit]
    parts = [k.replace("_K_FULL", "").replace("_FULL", "") for k, _ in shown]
    more = len(items) - len(shown)
    return ", ".join(parts) + (f", +{more} more (-v)" if more > 0 else "")


def _fit_widths(natural: list[int], minimum: list[int], limit: int) -> list[int]:
    """Shrinks the widest shrinkable column, one character at a time, until the table fits ``limit``."""
    widths = list(natural)
    overhead = 3 * len(widths) - 1  # " cell " per column plus "|" between columns
    while sum(widths) + overhead > limit:
        cands = [i for i, w in enumerate(widths) if w > minimum[i]]
        if not cands:
            break
        i = max(cands, key=lambda j: widths[j] - minimum[j])
        widths[i] -= 1
    return widths


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    title: str | None = None,
    width: int | None = None,
    min_widths: Sequence[int] | None = None,
) -> str:
    """A plain monospace table. With ``width``, columns wider than their ``min_widths`` entry wrap (at
    spaces where possible) so every line fits in ``width`` columns."""
    rows = [[str(c) for c in r] for r in rows]
    natural = [max([len(str(h))] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    if width is not None:  # headers may wrap at spaces: a column need not be wider than its longest header word
        natural = [max([len(x) for x in str(h).split()] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
        mins = list(min_widths) if min_widths is not None else natural
        widths = _fit_widths(natural, [min(m, n) for m, n in zip(mins, natural)], width)
    else:
        widths = natural

    def cell_lines(text: str, w: int) -> list[str]:
        return textwrap.wrap(text, w, break_on_hyphens=False) or [""]

    def lines(cells) -> list[str]:
        wrapped = [cell_lines(str(c), w) for c, w in zip(cells, widths)]
        height = max(len(x) for x in wrapped)
        return [
            "|".join(f" {(x[k] if k < len(x) else ''):<{w}} " for x, w in zip(wrapped, widths)).rstrip()
            for k in range(height)
        ]

    sep = "+".join("-" * (w + 2) for w in widths)
    out = [title] if title else []
    out += lines(headers) + [sep]
    for r in rows:
        out += lines(r)
    return "\n".join(out)


def _steps_cell(f: dict) -> str:
    lat = f["steps_to_detect"]
    if not lat:
        return "-"
    return f"{f['mean_steps_to_detect']:g} (max {f['max_steps_to_detect']})" if len(lat) > 1 else str(lat[0])


def fault_rows(summary: dict, *, verbose: bool = False) -> list[list[str]]:
    rows = []
    for f in summary["faults"]:
        counts = "-" if f.get("status") == "not_applicable" else f"{f['detected']}/{f['injected']}"
        rows.append(
            [
                f["kind"],
                f["caught_by"],
                counts,
                _steps_cell(f),
                _short_reasons(f["fail_reasons"], None if verbose else 4),
                f["verdict"],
            ]
        )
    return rows


FAULT_HEADERS = [
    "fault kind",
    "should be caught by",
    "detected/ injected",
    "steps to detect*",
    "fail reasons fired (launch:reason)",
    "verdict",
]
FAULT_MIN_WIDTHS = [14, 18, 9, 9, 25, 20]
STEPS_FOOTNOTE = (
    "* steps to detect: forward steps from injection to first violation (mean, max over trials); "
    "0 = caught in the same step"
)


def _wrap(text: str, indent: str = "  ") -> str:
    return "\n".join(
        textwrap.fill(line, WIDTH, subsequent_indent=indent, break_on_hyphens=False) for line in text.split("\n")
    )


def timing_rows(summary: dict) -> list[list[str]]:
    t = summary["timing"]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    # The rows and their wording come from the summary, which knows what was measured (its timing note).
    return [[p["part"], fmt(p["median_ms"]), fmt(p["mean_ms"])] for p in t["parts"]] + [
        [f"canary SWEEP (per pass, {t['sweep_passes']} passes)", fmt(t["sweep_ms_per_pass_median"]), "-"],
        ["canary SWEEP amortized (per step)", "-", fmt(t["sweep_ms_per_step_amortized"])],
    ]


def render_text(summary: dict, *, out: TextIO | None = None, verbose: bool = False) -> None:
    """Prints the report (rich tables when rich is installed and ``out`` is a terminal, plain text otherwise),
    every line within :data:`WIDTH` columns. ``verbose`` lists every fail reason instead of the top four.

    ``out`` defaults to the *current* ``sys.stdout`` (looked up per call, not bound at import time).
    """
    out = sys.stdout if out is None else out
    c = summary["canary"]
    t = summary["timing"]
    w = summary["workload"]
    head = [
        f"canary: real-KV hash {c['real_kv_hash_mode']}, sweep every {c['sweep_interval']} steps, "
        f"token oracle {'on' if c['token_oracle'] else 'off'}; backend {t['backend']} on {t['device']}",
        f"workload: {w['num_requests']} requests x {w['max_new_tokens']} new tokens, "
        f"{w['prefix_hit_tokens']}/{w['prompt_tokens']} prompt tokens from the prefix cache, "
        f"{w['pages_allocated']} page allocations from a {summary['engine']['num_pages'] - 1}-page pool, "
        f"{w['pages_evicted']} pages evicted from the prefix cache (clean phase)",
    ]
    fp_line = f"false positives (clean phase + before injections): {summary['false_positives']}" + (
        "" if not summary["false_positives"] else f"  {summary['false_positive_reasons']}"
    )
    overhead = f"canary overhead vs model: {t['canary_overhead_pct']}% (mean, sweep amortized)"
    if t["device"].startswith("cpu"):
        where = (
            "CPU figures: jnp reference kernels on the CPU"
            if t["backend"] == "reference"
            else "CPU figures: Pallas kernels in interpret mode on the CPU"
        )
    else:
        where = f"{t['device']}, {t['backend']} kernels"
    timing_title = f"time per step, ms ({t['clean_steps']} clean steps, compile excluded; {where})"
    notes = []
    for f in summary["faults"]:
        if f.get("status") == "not_applicable":
            notes.append(f"- {f['kind']}: not applicable: {f['not_applicable_reason']}; no episodes run")
        elif not f["expected_detect"]:
            notes.append(f"- {f['kind']}: {f['expected_miss_reason']} -> a miss is expected in this configuration")
    verdict = (
        "OK: every fault the configuration should catch was caught, no false positives"
        if summary["ok"]
        else "FAIL: "
        + "; ".join(
            [f"{f['kind']} {f['verdict']}" for f in summary["faults"] if not f["ok"]]
            + ([f"{summary['false_positives']} false positives"] if summary["false_positives"] else [])
            + [f"health check: {e}" for e in summary.get("health_errors", [])]
        )
    )
    rows = fault_rows(summary, verbose=verbose)
    use_rich = False
    if hasattr(out, "isatty") and out.isatty() and not os.environ.get("NO_COLOR"):
        try:
            import rich  # noqa: F401

            use_rich = True
        except ImportError:
            pass
    if use_rich:  # rich wraps to the terminal itself (at most WIDTH columns)
        from rich.console import Console
        from rich.table import Table

        con = Console(file=out)
        con.width = min(con.width, WIDTH)
        for line in head:
            con.print(line)
        tab = Table(title="fault campaign")
        for h in FAULT_HEADERS:
            h = h.replace("detected/ ", "detected/\n").replace("steps to ", "steps to\n")
            tab.add_column(h, overflow="fold", min_width=14 if h == "fault kind" else None, no_wrap=h == "fault kind")
        for r in rows:
            style = "green" if r[-1] == "ok" else ("yellow" if r[-1].startswith(("expected", "ok", "n/a")) else "red")
            tab.add_row(*r, style=style)
        con.print(tab)
        con.print(STEPS_FOOTNOTE)
        con.print(fp_line, style="green" if not summary["false_positives"] else "red")
        tt = Table(title=timing_title)
        for h in ("part", "median", "mean"):
            tt.add_column(h)
        for r in timing_rows(summary):
            tt.add_row(*r)
        con.print(tt)
        con.print(overhead)
        for n in notes:
            con.print(n, style="yellow")
        con.print(verdict, style="bold green" if summary["ok"] else "bold red")
        return
    for line in head:
        print(_wrap(line), file=out)
    print(file=out)
    print(table(FAULT_HEADERS, rows, title="fault campaign", width=WIDTH, min_widths=FAULT_MIN_WIDTHS), file=out)
    print(_wrap(STEPS_FOOTNOTE), file=out)
    print(file=out)
    print(_wrap(fp_line), file=out)
    print(file=out)
    print(table(["part", "median", "mean"], timing_rows(summary), title=_wrap(timing_title)), file=out)
    print(overhead, file=out)
    for n in notes:
        print(_wrap(n), file=out)
    print(_wrap(verdict), file=out)


# Fixed colours per outcome (the legend uses explicit handles, never a bar's colour).
C_INJECTED, C_DETECTED, C_MISSED, C_EXPECTED_MISS, C_NOT_INJECTED, C_LATENCY = (
    "#9aa5b1",
    "#2e7d32",
    "#c62828",
    "#f9a825",
    "#616161",
    "#1565c0",
)
_NO_LATENCY = {  # status -> (label in the latency panel, edge colour)
    "missed": ("MISSED", C_MISSED),
    "expected_miss": ("expected miss", C_EXPECTED_MISS),
    "not_injected": ("not injected", C_NOT_INJECTED),
    "not_applicable": ("n/a", C_NOT_INJECTED),
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def plot(summary: dict, path: str) -> None:
    """Writes :func:`plot_figure` as a PNG.

    Raises:
      OSError: ``path`` cannot be written.
      ImportError: matplotlib is not installed (the CLI checks for it before a run).
    """
    plt = _pyplot()
    fig = plot_figure(summary)
    try:
        fig.savefig(path, dpi=110, format="png")
    finally:
        plt.close(fig)


def plot_figure(summary: dict):
    """Two panels: trials injected / detected / missed per fault kind, and steps from injection to the first
    violation for the kinds that were detected (a diamond on the axis marks "caught in the same step"; kinds
    without a detection get a hatched, labelled placeholder instead of a bar of height 0)."""
    plt = _pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    faults = summary["faults"]
    kinds = [f["kind"] for f in faults]
    x = list(range(len(kinds)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(10, 1.5 * len(kinds) + 4), 4.8))

    # --- panel 1: trials --------------------------------------------------------------------------------------
    top = max([f["trials"] for f in faults] + [1])
    seen = set()
    for i, f in enumerate(faults):
        inj, det, trials = f["injected"], f["detected"], f["trials"]
        status = f.get("status", "ok")
        if status == "not_applicable":
            ax1.bar(i, top, width=0.8, facecolor="white", edgecolor=C_NOT_INJECTED, hatch="..", alpha=0.5)
            ax1.text(
                i,
                0.5 * top,
                "n/a",
                ha="center",
                va="center",
                fontsize=8,
                color=C_NOT_INJECTED,
                bbox=dict(facecolor="white", edgecolor="none", pad=1),
            )
            seen.add("na")
            continue
        ax1.bar(i - 0.2, inj, width=0.4, color=C_INJECTED)
        if trials > inj:
            ax1.bar(
                i - 0.2, trials - inj, width=0.4, bottom=inj, facecolor="white", edgecolor=C_NOT_INJECTED, hatch="//"
            )
            seen.add("not_injected")
        ax1.bar(i + 0.2, det, width=0.4, color=C_DETECTED)
        if inj > det:
            col = C_MISSED if f["expected_detect"] else C_EXPECTED_MISS
            ax1.bar(i + 0.2, inj - det, width=0.4, bottom=det, facecolor="white", edgecolor=col, hatch="xx")
            seen.add("missed" if f["expected_detect"] else "expected_miss")
    handles = [Patch(color=C_INJECTED, label="injected"), Patch(color=C_DETECTED, label="detected")]
    if "missed" in seen:
        handles.append(Patch(facecolor="white", edgecolor=C_MISSED, hatch="xx", label="missed (should be caught)"))
    if "expected_miss" in seen:
        handles.append(Patch(facecolor="white", edgecolor=C_EXPECTED_MISS, hatch="xx", label="expected miss"))
    if "not_injected" in seen:
        handles.append(Patch(facecolor="white", edgecolor=C_NOT_INJECTED, hatch="//", label="not injected"))
    if "na" in seen:
        handles.append(Patch(facecolor="white", edgecolor=C_NOT_INJECTED, hatch="..", label="not applicable"))
    ax1.set_xticks(x, kinds, rotation=35, ha="right")
    ax1.set_xlim(-0.7, len(kinds) - 0.3)
    ax1.set_ylabel("trials")
    wide = len(kinds) >= 6  # legends in 3 columns; else one column, which needs more headroom
    ax1.set_ylim(0, top * (1.45 if wide else 1.25 + 0.12 * len(handles)))
    ax1.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.set_title(
        f"detection per fault kind (real-KV {summary['canary']['real_kv_hash_mode']}), "
        f"false positives: {summary['false_positives']}",
        fontsize=9,
    )
    ax1.legend(handles=handles, loc="upper right", ncol=min(3, len(handles)) if wide else 1, fontsize=7)

    # --- panel 2: latency of the detected kinds -------------------------------------------------------------
    lat_max = max([f["max_steps_to_detect"] for f in faults if f["max_steps_to_detect"] is not None] + [1])
    content = lat_max * 1.15 + 0.3  # the bars, their labels and the placeholders stay below this
    ymax = content * (1.4 if len(kinds) >= 6 else 1.7)  # room above for the legend
    for i, f in enumerate(faults):
        mean = f["mean_steps_to_detect"]
        if mean is None:
            label, col = _NO_LATENCY.get(f.get("status"), ("no detection", C_NOT_INJECTED))
            ax2.bar(i, content, width=0.6, facecolor="white", edgecolor=col, hatch="//", alpha=0.5)
            ax2.text(
                i,
                content * 0.5,
                label,
                ha="center",
                va="center",
                rotation=90,
                fontsize=8,
                color=col,
                bbox=dict(facecolor="white", edgecolor="none", pad=1),
            )
            continue
        ax2.bar(i, mean, width=0.6, color=C_LATENCY)
        if f["max_steps_to_detect"] != mean:
            ax2.plot([i - 0.2, i + 0.2], [f["max_steps_to_detect"]] * 2, color="black", lw=1.5)
        if mean == 0:
            ax2.plot([i], [0], marker="D", markersize=8, color=C_LATENCY, clip_on=False, zorder=5)
        ax2.text(
            i,
            max(mean, f["max_steps_to_detect"]) + 0.04 * ymax,
            "same step" if f["max_steps_to_detect"] == 0 else f"{round(mean, 2):g}",
            ha="center",
            va="bottom",
            fontsize=7,
        )
    ax2.set_xticks(x, kinds, rotation=35, ha="right")
    ax2.set_xlim(-0.7, len(kinds) - 0.3)
    ax2.set_ylim(0, ymax)
    ax2.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_ylabel("steps from injection to first violation")
    ax2.set_title("detection latency (bar: mean, line: max over trials)", fontsize=9)
    det = [f for f in faults if f["mean_steps_to_detect"] is not None]
    lat_handles = [Patch(color=C_LATENCY, label="mean steps to detect")] if det else []
    if any(f["max_steps_to_detect"] != f["mean_steps_to_detect"] for f in det):
        lat_handles.append(Line2D([], [], color="black", lw=1.5, label="max (when above the mean)"))
    if any(f["mean_steps_to_detect"] == 0 for f in det):
        lat_handles.append(Line2D([], [], marker="D", color=C_LATENCY, lw=0, label="0 = caught in the same step"))
    if lat_handles:
        ax2.legend(handles=lat_handles, loc="upper right", ncol=3 if wide else 1, fontsize=7)
    else:
        ax2.set_title("detection latency: no fault kind was detected", fontsize=9)
    fig.tight_layout()
    return fig


def render_violation_samples(summary: dict, *, out: TextIO | None = None) -> None:
    """Prints the first violation of every episode in SGLang's report text (``out`` defaults to sys.stdout)."""
    out = sys.stdout if out is None else out
    for f in summary["faults"]:
        for ep in f["episodes"]:
            if ep.get("first_violation_text"):
                print(
                    f"--- {f['kind']} trial {ep['trial']}: injected at step {ep['inject_step']} "
                    f"{ep['details']}, first violation at step {ep['detect_step']}",
                    file=out,
                )
                print(ep["first_violation_text"], file=out)
