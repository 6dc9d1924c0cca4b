"""Launch replay: a steady-state native launch on CUDA is one torch CUDA-graph replay.

A native launch runs 15 to 60 torch ops and Triton launches (the buckets' staging copies, the glue XLA would
fuse, the kernels); each costs the host thread a few microseconds, a few hundred per launch in all. A serving
engine calls the launchers with the same tensors step after step (the canary state, the plan buffers, static
input buffers), so the launchers key each call on everything its checks and its program depend on (every
tensor's address, shape, strides, dtype and device; every flag, size and enum by value; the environment's path
and backend, x64, inference and grad mode, the default bucket policy) and:

* the first ``CAPTURE_AFTER - 1`` sightings of a key run eagerly (which also builds and loads every kernel); a
  launch that raises is not a sighting;
* the next one captures the launch (staging copies, program, write-back) in a ``torch.cuda.CUDAGraph`` on a side
  stream, then replays it;
* later ones skip the checks (the same facts passed them) and replay the graph on the current stream.

A graph reads and writes the memory its key names, plus its own staging buffers and intermediates (held by its
entry and its private memory pool), so a replay does what an eager launch would on the tensors of that call,
whoever owns that memory now. There is no replay (every launch eager, with its checks) where it could differ:
tensors on another device than the current one, a 0-d tensor passed for a flag or a size (read at every eager
launch), arguments the key cannot name (DLPack objects), the DLPack path, a shape that fell back to it, inside a
caller's own capture (the caller's graph records the eager launch), or after a capture that failed (one
``RuntimeWarning``).

``$CANARY_JAX_NATIVE_GRAPHS`` caps the graphs kept (least recently used evicted, with their memory), default
:data:`DEFAULT_MAX_GRAPHS`; ``0`` turns replay off at once (graphs dropped, every launch eager). A graph evicted
before :data:`MIN_REPLAYS` replays leaves its key eager: more keys rotate than the cap holds.
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
import warnings
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import torch

from interop.native import environ
from interop.native.keys import (  # noqa: F401 - the key pieces, re-exported where the launchers and tests take them
    Collector,
    GuardedKeys,
    KeyMemo,
    NotKeyable,
    fields_sig,
    full_tensor_key,
    layout_key,
    sig,
    tensor_key,
    tensors_sig,
    value_sig,
)

GRAPHS_ENV = "CANARY_JAX_NATIVE_GRAPHS"
"""Environment variable: how many launch graphs to keep (``0``: replay off)."""

DEFAULT_MAX_GRAPHS = 64
CAPTURE_AFTER = 2
"""A key is captured at its second sighting (the first ran eagerly: every kernel built and loaded)."""

_MAX_SEEN = 4096


def max_graphs() -> int:
    """``$CANARY_JAX_NATIVE_GRAPHS`` as an int (default :data:`DEFAULT_MAX_GRAPHS`).

    Raises:
      ValueError: not a non-negative integer, naming the variable.
    """
    raw = environ.get(GRAPHS_ENV)
    if raw is None:
        return DEFAULT_MAX_GRAPHS
    return _parse_max_graphs(raw)


@functools.lru_cache(maxsize=16)
def _parse_max_graphs(raw: str) -> int:  # memoised: replay reads the variable on every launch
    if raw.strip() == "":
        return DEFAULT_MAX_GRAPHS
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"kv-canary: ${GRAPHS_ENV} must be a non-negative integer (0 turns replay off), got {raw!r}")
    return n


_OWN = threading.local()


def own_capture() -> bool:
    """Whether this thread is inside one of the launchers' own captures (which keep their staging buffers)."""
    return getattr(_OWN, "active", False)


class _Entry:
    __slots__ = ("graph", "keep", "replays", "used")

    def __init__(self, graph: torch.cuda.CUDAGraph, keep: tuple):
        self.graph = graph
        self.keep = keep  # tensors the graph reads or writes that the caller does not own (staging buffers)
        self.replays = 0
        self.used = 0  # the tick of its last replay (least recently used evicted first)


_EAGER = -1  # a key's sighting count when it must stay eager (fell back, failed to capture, or thrashed)
MIN_REPLAYS = 16
"""A graph evicted after fewer replays than this leaves its key eager: more keys are in rotation than the cap
holds, and capturing them again and again would cost more than it saves."""


class LaunchGraphs:
    """Keys seen (capped at a few thousand, least recently seen forgotten first), and the graphs captured for
    them (capped by :func:`max_graphs`, least recently used evicted first).

    A replay costs one dict lookup of its key: the graphs are a plain dict whose entries carry the tick of their
    last replay (no reordering, no lock on the replay path); eviction, at a capture, scans them."""

    def __init__(self):
        self._graphs: dict[Hashable, _Entry] = {}
        self._seen: collections.OrderedDict[Hashable, int] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._tick = itertools.count(1)
        self.captures = 0
        self.replays = 0

    def clear(self) -> None:
        with self._lock:
            self._graphs.clear()
            self._seen.clear()

    def __len__(self) -> int:
        return len(self._graphs)

    def replay(self, key: Hashable | None) -> bool:
        """Replays ``key``'s graph on the current stream if there is one; whether it did. With
        ``$CANARY_JAX_NATIVE_GRAPHS=0`` it drops every graph and replays none."""
        if key is None or not self._graphs:
            return False
        entry = self._graphs.get(key)
        if entry is None:
            return False
        if max_graphs() == 0:  # replay was turned off since these were captured
            self.clear()
            return False
        if torch.cuda.is_current_stream_capturing():  # the caller captures: record the eager launch instead
            return False
        entry.graph.replay()
        entry.used = next(self._tick)
        entry.replays += 1
        self.replays += 1
        return True

    def _note(self, key: Hashable, n: int) -> None:
        with self._lock:
            self._seen.pop(key, None)
            self._seen[key] = n
            while len(self._seen) > _MAX_SEEN:
                self._seen.popitem(last=False)

    def run(self, key: Hashable | None, launch: Callable[[], tuple[bool, Iterable[torch.Tensor]]]) -> None:
        """Runs ``launch`` for ``key``: eagerly, or captured then replayed at the key's :data:`CAPTURE_AFTER`-th
        sighting. ``launch()`` returns ``(capturable, tensors)``: whether it ran on the native path, and the
        tensors it handed the program (the staging buffers among them are kept alive with the graph). A launch
        that raises is not a sighting.
        """
        limit = max_graphs() if key is not None else 0
        if key is None or limit == 0 or torch.cuda.is_current_stream_capturing():
            launch()
            return
        n = self._seen.get(key, 0)
        if n == _EAGER:
            launch()
            return
        if n + 1 < CAPTURE_AFTER:
            capturable, _ = launch()
            self._note(key, n + 1 if capturable else _EAGER)
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
                _OWN.active = True
                try:
                    capturable, tensors = launch()
                finally:
                    _OWN.active = False
                    graph.capture_end()
        except Exception as e:  # noqa: BLE001 - nothing captured ran; launch eagerly from now on
            self._note(key, _EAGER)
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
        if not capturable:  # it took the DLPack path, which ran for real (not captured): nothing to replay
            self._note(key, _EAGER)
            return
        entry = self._store(key, graph, tuple(tensors), limit)
        graph.replay()
        entry.replays += 1
        self.replays += 1

    def _store(self, key: Hashable, graph: Any, keep: tuple, limit: int) -> _Entry:
        """Keeps ``graph`` for ``key``, evicting the least recently used past ``limit``; an evicted key that
        replayed fewer than :data:`MIN_REPLAYS` times stays eager, the others start counting sightings again."""
        entry = _Entry(graph, keep)
        entry.used = next(self._tick)
        evicted = []
        with self._lock:
            self._graphs[key] = entry
            self.captures += 1
            while len(self._graphs) > limit:
                old_key = min(self._graphs, key=lambda k: self._graphs[k].used)
                evicted.append((old_key, self._graphs.pop(old_key)))
        for old_key, old in evicted:
            self._note(old_key, _EAGER if old.replays < MIN_REPLAYS else 0)
        return entry


GRAPHS = LaunchGraphs()
"""The launchers' launch graphs (one per process)."""
