"""The demo's progress bar: tqdm from the ``demo`` extra, imported only when a bar is asked for.

Without tqdm the demo runs the same, with no bar and one line on stderr saying how to get one.
"""

from __future__ import annotations

import sys
from typing import TextIO

from canary_jax.cli.args import DEMO_EXTRA_HINT


class Progress:
    """A progress bar over a campaign's episodes (one tick per finished episode), or a no-op.

    Pass :meth:`on_episode` and :meth:`on_step` as the campaign's callbacks and call :meth:`close` at the end,
    also when the run fails.
    """

    def __init__(self, bar=None):
        self._bar = bar  # a tqdm instance, or None for no bar
        self._label = ""

    def on_episode(self, label: str) -> None:
        """An episode named ``label`` starts (the one before it, if any, is done)."""
        if self._bar is not None and self._label:
            self._bar.update(1)
        self._label = label

    def on_step(self, label: str, step: int) -> None:
        """Forward step ``step`` of episode ``label`` finished (the bar redraws every 8 steps)."""
        if self._bar is not None:
            self._bar.set_postfix_str(f"{label} step {step}", refresh=False)
            if step % 8 == 0:
                self._bar.refresh()

    def close(self) -> None:
        """Counts the last episode and removes the bar."""
        if self._bar is not None:
            self._bar.update(1)
            self._bar.close()
            self._bar = None


def open_progress(total: int, *, enabled: bool = True, err: TextIO | None = None) -> Progress:
    """A bar of ``total`` episodes on ``err`` (default: the current ``sys.stderr``), or a no-op one.

    With ``enabled`` False, tqdm is not imported. When tqdm is missing, one line on ``err`` says how to install
    it and the returned :class:`Progress` draws nothing. tqdm itself hides the bar when ``err`` is not a
    terminal.
    """
    if not enabled:
        return Progress()
    err = sys.stderr if err is None else err
    try:
        from tqdm import tqdm
    except ImportError:
        print(f"canary-jax: no progress bar: tqdm is not installed ({DEMO_EXTRA_HINT} gives one)", file=err)
        return Progress()
    return Progress(
        tqdm(
            total=total, unit="episode", desc="canary-jax demo", file=err, dynamic_ncols=True, leave=False, disable=None
        )
    )
