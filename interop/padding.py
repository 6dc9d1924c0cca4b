"""The torch launchers' launch shapes padded to buckets (:mod:`canary_jax.ops.buckets`), like the JAX entry points.

A serving engine's token counts and plan capacities change every step; each distinct shape would compile a new
program. The verify and write launchers therefore pass bucket-sized *copies* of their small read-only inputs
(the plan tensors, the token tensors) when a size is not a bucket already; the in-place outputs (canary buffer,
ring, write index, counters) keep their shapes and are never copied. The padding rules are those of
:mod:`canary_jax.ops.padding` (padded entries are never written or counted; the result is byte-identical):

* verify: ``C -> Cp``; new entries ``(slot 0, token -1, position 0, prev 0)``; ``verify_num_valid`` becomes
  ``min(num_valid, C)``.
* write: ``T -> Tp`` (ids 0, positions 0, slots -1, expected 0); offsets clamped into ``[0, T]`` when ``T``
  grows; ``Cw -> Cwp`` (seed -1, last offset repeated); ``write_num_valid_reqs`` becomes ``min(n, Cw)``.

The copies are staging tensors on the tensors' device, one per (caller tensor, bucket, role), kept while the
caller's tensor lives; their padded rows are filled once and their live rows refilled on torch's current stream
before every launch (torch ops, no compile: the plain row copies of a launch in one ``torch._foreach_copy_``). So a
steady-state launch imports nothing new, and a refill cannot overtake the previous launch: after a launch,
torch's current stream waits for it (:mod:`interop.runner`). A staging tensor used inside a caller's own CUDA-graph
capture is kept for the life of the process, since that graph may replay it after the caller's tensor is gone.
"""

from __future__ import annotations

import torch

from canary_jax.contract import ints
from canary_jax.ops.buckets import Buckets, bucket_size
from interop import dlpack
from interop.native import replay

_STAGES = dlpack.ImportCache(max_entries=512)  # staging tensors, entries die with the caller's tensor
_PINNED: dict = {}  # staging tensors a caller's CUDA graph captured: kept for the process (the graph may replay)


def _pinned(t: torch.Tensor) -> bool:
    """Whether staging for ``t`` happens inside a caller's own CUDA-graph capture: the graph keeps the buffer's
    address, while the cache entry dies with the caller's tensor object (graph runners pass a new slice each call),
    so the buffer is pinned. The launchers' own graphs keep their staging buffers themselves
    (:mod:`interop.native.replay`)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing() and not replay.own_capture()


def _stage(t: torch.Tensor, rows: int, role: str, pin: bool) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``(staging tensor, its first len(t) rows, whether it is new)`` for ``t`` padded to ``rows`` in ``role``;
    ``pin``: :func:`_pinned`."""
    # a staging tensor made in inference mode is an inference tensor, which torch will not refill outside it
    key = dlpack.ImportCache.key_for(t, (rows, role, torch.is_inference_mode_enabled()))
    hit = _PINNED.get(key) if pin else None
    if hit is None:
        hit = _STAGES.get(key)
    fresh = hit is None
    if fresh:
        out = torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
        hit = (out, out[: t.shape[0]])
        _STAGES.put(key, hit, (t,))
    if pin:
        _PINNED[key] = hit
    return (*hit, fresh)


class _Refill:
    """The staging refills of one launch, issued together: every plain row copy in one ``torch._foreach_copy_``
    (one kernel on CUDA for tensors of one dtype), then the clamps, then the edge rows (which read the rows
    above them)."""

    def __init__(self):
        self.dst: list[torch.Tensor] = []
        self.src: list[torch.Tensor] = []
        self.edges: list[tuple[torch.Tensor, int, int]] = []
        self.pin: bool | None = None  # _pinned, asked once per launch (its tensors share a device)

    def pad(
        self, t: torch.Tensor, rows: int, *, fill: int = 0, edge: bool = False, clamp: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """:func:`pad_rows`' staging tensor, its refill queued until :meth:`run`."""
        n = int(t.shape[0])
        if n == rows and clamp is None:
            return t
        if self.pin is None:
            self.pin = _pinned(t)
        out, head, fresh = _stage(t, rows, f"{fill}/{edge}/{clamp is not None}", self.pin)
        if clamp is None:
            self.dst.append(head)
            self.src.append(t)
        else:
            torch.clamp(t, clamp[0], clamp[1], out=head)
        if n < rows:
            if edge:
                self.edges.append((out, n, rows))
            elif fresh:
                out[n:].fill_(fill)
        return out

    def run(self) -> None:
        if len(self.dst) == 1:
            self.dst[0].copy_(self.src[0])
        elif self.dst:
            torch._foreach_copy_(self.dst, self.src)
        for out, n, rows in self.edges:
            out[n:].copy_(out[n - 1 : n].expand(rows - n, *out.shape[1:]))


def pad_rows(
    t: torch.Tensor, rows: int, *, fill: int = 0, edge: bool = False, clamp: tuple[int, int] | None = None
) -> torch.Tensor:
    """``t`` (dim 0 of length ``n <= rows``) grown to ``rows`` rows in a staging tensor (``t`` itself if
    ``n == rows`` and no clamp). A staging tensor is only ever read by launches, so its ``fill`` rows are written
    once, when it is made; its first ``n`` rows (and ``edge`` rows) are refilled at every call.

    Args:
      t: a 1-D (or more) tensor.
      rows: the padded length.
      fill: the value of the new rows.
      edge: repeat the last row (after the clamp) instead (``n >= 1``).
      clamp: ``(lo, hi)``: the first ``n`` rows are ``t`` clamped into ``[lo, hi]``.
    """
    refill = _Refill()
    out = refill.pad(t, rows, fill=fill, edge=edge, clamp=clamp)
    refill.run()
    return out


def _min(refill: _Refill, t: torch.Tensor, cap: int) -> torch.Tensor:
    return refill.pad(t, int(t.shape[0]), clamp=(ints.INT32_MIN, cap))


def verify_plan(pl: dict[str, torch.Tensor], buckets: Buckets | None = None) -> dict[str, torch.Tensor]:
    """The verify plan tensors (``plan.<field>`` keys) with a bucket capacity (the same dict if already one)."""
    c = int(pl["plan.verify_slot_indices"].shape[0])
    cp = bucket_size(c, buckets)
    if cp == c:
        return pl
    refill = _Refill()
    out = {
        "plan.verify_slot_indices": refill.pad(pl["plan.verify_slot_indices"], cp),
        "plan.verify_expected_tokens": refill.pad(pl["plan.verify_expected_tokens"], cp, fill=-1),
        "plan.verify_expected_positions": refill.pad(pl["plan.verify_expected_positions"], cp),
        "plan.verify_prev_slot_indices": refill.pad(pl["plan.verify_prev_slot_indices"], cp),
        "plan.verify_num_valid": _min(refill, pl["plan.verify_num_valid"], c),
        "plan.enable": pl["plan.enable"],
    }
    refill.run()
    return out


_TOKEN_FILLS = {"out_cache_loc": -1}  # a padded token's slot: skipped (it belongs to no request anyway)


def write_inputs(
    pl: dict[str, torch.Tensor], toks: dict[str, torch.Tensor], buckets: Buckets | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The write plan (``plan.<field>``) and token tensors with bucket sizes (the same dicts if already)."""
    t = int(toks["input_ids"].shape[0])
    tp = bucket_size(t, buckets)
    cw = int(pl["plan.write_seed_slot_indices"].shape[0])
    cwp = bucket_size(cw, buckets)
    if tp == t and cwp == cw:
        return pl, toks
    refill = _Refill()
    if tp != t:
        toks = {n: refill.pad(x, tp, fill=_TOKEN_FILLS.get(n, 0)) for n, x in toks.items()}
    pl = {
        "plan.write_offsets": refill.pad(
            pl["plan.write_offsets"], cwp + 1, edge=True, clamp=(0, t) if tp != t else None
        ),
        "plan.write_seed_slot_indices": refill.pad(pl["plan.write_seed_slot_indices"], cwp, fill=-1),
        "plan.write_num_valid_reqs": _min(refill, pl["plan.write_num_valid_reqs"], cw),
    }
    refill.run()
    return pl, toks
