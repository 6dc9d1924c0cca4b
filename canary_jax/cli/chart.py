"""The PNG chart of a campaign summary (see :func:`canary_jax.cli.demo.summary.summarize`): trials injected /
detected / missed per fault kind, and the steps from injection to the first violation.

matplotlib (the ``demo`` extra) is imported only by :func:`plot` / :func:`plot_figure`, never at module import;
a missing matplotlib raises ``ImportError`` there. :mod:`canary_jax.cli.render` re-exports every name here.
"""

from __future__ import annotations

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
