"""Text tables of a campaign summary (see :func:`canary_jax.cli.demo.summary.summarize`), SGLang's violation
texts, and the plain :func:`table` that ``verify-dump`` prints its per-reason counts with.

The tables use rich when it is installed and the output is a terminal, plain text otherwise. The PNG chart
(:func:`plot`, :func:`plot_figure`, the outcome colours) lives in :mod:`canary_jax.cli.chart` and is re-exported
here; it needs matplotlib (the ``demo`` extra), imported only when a chart is drawn.
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Sequence
from typing import TextIO

from canary_jax.cli.chart import _NO_LATENCY as _NO_LATENCY
from canary_jax.cli.chart import C_DETECTED as C_DETECTED
from canary_jax.cli.chart import C_EXPECTED_MISS as C_EXPECTED_MISS
from canary_jax.cli.chart import C_INJECTED as C_INJECTED
from canary_jax.cli.chart import C_LATENCY as C_LATENCY
from canary_jax.cli.chart import C_MISSED as C_MISSED
from canary_jax.cli.chart import C_NOT_INJECTED as C_NOT_INJECTED
from canary_jax.cli.chart import _pyplot as _pyplot
from canary_jax.cli.chart import plot as plot
from canary_jax.cli.chart import plot_figure as plot_figure

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
