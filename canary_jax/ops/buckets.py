"""Launch-shape buckets: a serving engine's sizes change every step, compiled programs must not.

Every distinct launch shape (token count, plan capacity, batch rows) is a new compiled program: seconds of
compile on the GPU, and on XLA:CPU hundreds of memory mappings that are never released (see
``../shared/PITFALLS.md``). Entry points therefore pad each varying size up to a bucket: the smallest power of
two that is at least ``minimum``, or the smallest entry of a configured bucket list. Padded entries are dead by
construction (past a plan's live count, or owned by no request) and are never written or counted.

The default policy can be replaced per process with :func:`set_default_buckets` (e.g. the sizes a serving
engine already pads its batches to) or per call where an entry point takes ``buckets=``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Buckets:
    """A bucket policy (hashable, so it can be a static argument).

    Fields:
      sizes: ascending positive bucket sizes; a size above the largest falls back to powers of two. Empty:
        powers of two only.
      minimum: the smallest bucket when ``sizes`` is empty (a power of two).

    Raises:
      ValueError: sizes not positive and strictly ascending, or a minimum that is not a positive power of two.
    """

    sizes: tuple[int, ...] = ()
    minimum: int = 16

    def __post_init__(self) -> None:
        sizes = tuple(int(s) for s in self.sizes)
        if any(s <= 0 for s in sizes) or any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"kv-canary: bucket sizes must be positive and strictly ascending, got {sizes}")
        if self.minimum < 1 or self.minimum & (self.minimum - 1):
            raise ValueError(f"kv-canary: bucket minimum must be a positive power of two, got {self.minimum}")
        object.__setattr__(self, "sizes", sizes)

    def size_for(self, n: int) -> int:
        """The bucket that holds ``n`` (``n >= 0``): ``>= max(n, 1)``."""
        n = max(int(n), 1)
        for s in self.sizes:
            if s >= n:
                return s
        if self.sizes and n > self.sizes[-1]:
            floor = self.sizes[-1]
        else:
            floor = self.minimum
        size = 1 << (n - 1).bit_length()
        return max(size, floor)


_DEFAULT = [Buckets()]


def default_buckets() -> Buckets:
    """The process-wide bucket policy (powers of two from 16 unless :func:`set_default_buckets` changed it)."""
    return _DEFAULT[0]


def set_default_buckets(sizes: Sequence[int] = (), *, minimum: int = 16) -> Buckets:
    """Replaces the process-wide bucket policy; returns the new one.

    Raises:
      ValueError: see :class:`Buckets`.
    """
    _DEFAULT[0] = Buckets(sizes=tuple(sizes), minimum=minimum)
    return _DEFAULT[0]


def bucket_size(n: int, buckets: Buckets | None = None) -> int:
    """The padded size for a launch dimension of ``n`` under ``buckets`` (default: :func:`default_buckets`)."""
    return (buckets or default_buckets()).size_for(n)
