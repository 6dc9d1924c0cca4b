"""Launch replay: a steady-state native launch on CUDA is one torch CUDA-graph replay.

A native launch runs 15 to 60 torch ops and Triton launches (the buckets' staging copies, the glue XLA would
fuse, the kernels); each costs the host thread a few microseconds, a few hundred per launch in all. A serving
engine calls the launchers with the same tensors step after step (the canary state, the plan buffers, static
input buffers), so the launchers key each call on everything its checks and its program depend on (every
tensor's address, shape, strides, dtype and device, every scalar and static field, the environment's path and
backend, x64, inference mode) and:

* the first ``CAPTURE_AFTER - 1`` sightings of a key run eagerly (which also builds and loads every kernel);
* the next one captures the launch (staging copies, program, write-back) in a ``torch.cuda.CUDAGraph`` on a side
  stream, then replays it;
* later ones skip the checks (the same facts passed them) and replay the graph on
  ``torch.cuda.current_stream()``: one graph launch of host time.

A graph reads and writes exactly the memory its key names, so a replay does what an eager launch would on the
tensors of that call, whoever owns that memory now. Staging buffers and intermediates are the graph's own (held
by the entry and its private memory pool). Nothing is captured while the caller's stream is capturing (the
caller's graph records the eager launch), for the DLPack path, or for a launch that fell back to it; a capture
that fails leaves that key eager with one ``RuntimeWarning``.

``$CANARY_JAX_NATIVE_GRAPHS`` caps the graphs kept (least recently used evicted, with their memory), default
:data:`DEFAULT_MAX_GRAPHS`; ``0`` turns replay off (every launch eager, with its checks).
"""

from __future__ import annotations

import collections
import os
import threading
import warnings
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch

GRAPHS_ENV = "CANARY_JAX_NATIVE_GRAPHS"
"""Environment variable: how many launch graphs to keep (``0``: replay off)."""

DEFAULT_MAX_GRAPHS = 32
CAPTURE_AFTER = 2
"""A key is captured at its second sighting (the first ran eagerly: every kernel built and loaded)."""

_MAX_SEEN = 4096


def max_graphs() -> int:
    """``$CANARY_JAX_NATIVE_GRAPHS`` as an int (default :data:`DEFAULT_MAX_GRAPHS`).

    Raises:
      ValueError: not a non-negative integer, naming the variable.
    """
    raw = os.environ.get(GRAPHS_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_MAX_GRAPHS
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"kv-canary: ${GRAPHS_ENV} must be a non-negative integer (0 turns replay off), got {raw!r}")
    return n


class NotKeyable(Exception):
    """An argument the replay key cannot name (not a torch tensor, an unhashable field): launch eagerly."""


def sig(x: Any) -> Hashable:
    """The replay key of one launcher argument: a tensor by its memory and layout, a sequence item by item,
    a scalar by value.

    Raises:
      NotKeyable: anything else (a DLPack object, an unhashable value).
    """
    if isinstance(x, torch.Tensor):
        return (x.data_ptr(), x.shape, x.stride(), x.dtype, x.get_device(), x.is_inference())
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (tuple, list)):
        return tuple(sig(v) for v in x)
    try:
        hash(x)
    except TypeError:
        raise NotKeyable(type(x).__name__) from None
    return (type(x), x)


def fields_sig(obj: Any, fields: Iterable[str]) -> tuple:
    """:func:`sig` of ``obj``'s attributes ``fields`` (a missing one keys as a marker; the checks will raise)."""
    return (type(obj), *(sig(getattr(obj, f, _MISSING)) for f in fields))


_MISSING = ("<missing>",)


class _Entry:
    __slots__ = ("graph", "keep")

    def __init__(self, graph: torch.cuda.CUDAGraph, keep: tuple):
        self.graph = graph
        self.keep = keep  # tensors the graph reads or writes that the caller does not own (staging buffers)


class LaunchGraphs:
    """Keys seen, and the graphs captured for them (least recently used first)."""

    def __init__(self):
        self._graphs: collections.OrderedDict[Hashable, _Entry] = collections.OrderedDict()
        self._seen: collections.OrderedDict[Hashable, int] = collections.OrderedDict()
        self._eager: set = set()  # keys that must stay eager (fell back to DLPack, or failed to capture)
        self._lock = threading.Lock()
        self.captures = 0
        self.replays = 0

    def clear(self) -> None:
        with self._lock:
            self._graphs.clear()
            self._seen.clear()
            self._eager.clear()

    def __len__(self) -> int:
        return len(self._graphs)

    def replay(self, key: Hashable | None) -> bool:
        """Replays ``key``'s graph on the current stream if there is one; whether it did."""
        if key is None or not self._graphs:
            return False
        entry = self._graphs.get(key)
        if entry is None:
            return False
        if torch.cuda.is_current_stream_capturing():  # the caller captures: record the eager launch instead
            return False
        with self._lock:
            if key in self._graphs:
                self._graphs.move_to_end(key)
        entry.graph.replay()
        self.replays += 1
        return True

    def run(self, key: Hashable | None, launch: Callable[[], tuple[bool, Iterable[torch.Tensor]]]) -> None:
        """Runs ``launch`` for ``key``: eagerly, or captured then replayed at the key's :data:`CAPTURE_AFTER`-th
        sighting. ``launch()`` returns ``(capturable, tensors)``: whether it ran on the native path, and the
        tensors it handed the program (the staging buffers among them are kept alive with the graph).
        """
        limit = max_graphs() if key is not None else 0
        if limit == 0 and self._graphs:  # replay was turned off: drop what it kept
            self.clear()
        if key is None or limit == 0 or key in self._eager or torch.cuda.is_current_stream_capturing():
            launch()
            return
        with self._lock:
            n = self._seen.pop(key, 0) + 1
            self._seen[key] = n
            while len(self._seen) > _MAX_SEEN:
                self._seen.popitem(last=False)
        if n < CAPTURE_AFTER:
            capturable, _ = launch()
            if not capturable:
                self._eager.add(key)
            return
        self._capture(key, launch, limit)

    def _capture(self, key: Hashable, launch: Callable, limit: int) -> None:
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream(device=current.device)
        side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    capturable, tensors = launch()
                finally:
                    graph.capture_end()
        except Exception as e:  # noqa: BLE001 - nothing captured ran; launch eagerly from now on
            self._eager.add(key)
            current.wait_stream(side)
            warnings.warn(
                f"kv-canary: could not capture a native launch in a CUDA graph ({type(e).__name__}: {e}); "
                "launches with these tensors run eagerly",
                RuntimeWarning,
                stacklevel=4,
            )
            launch()
            return
        current.wait_stream(side)
        if not capturable:  # it fell back to the DLPack path: nothing was captured that could replay it
            self._eager.add(key)
            launch()
            return
        entry = _Entry(graph, tuple(tensors))
        with self._lock:
            self._graphs[key] = entry
            self.captures += 1
            while len(self._graphs) > limit:
                self._graphs.popitem(last=False)
        graph.replay()
        self.replays += 1


GRAPHS = LaunchGraphs()
"""The launchers' launch graphs (one per process)."""
