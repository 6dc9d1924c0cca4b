"""Torch arguments of the SGLang launchers, turned into what :mod:`canary_jax.contract.validation` checks.

The checks themselves are :mod:`canary_jax.contract.validation`'s, shared with the JAX entry points; this module
only turns torch tensors into :class:`~canary_jax.contract.validation.ArrayFacts` (:func:`interop.dlpack.facts`, dtype
names as torch prints them: ``torch.int64``), gathers the launch's tensors by SGLang's argument names, and adds
the checks only a torch launch has (DLPack capsules, one device per launch).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from canary_jax.contract import constants, coverage, validation
from interop import dlpack
from interop.buffers import TensorArg

_MEMO = threading.local()


@contextlib.contextmanager
def facts_once() -> Iterator[None]:
    """Within: :func:`facts` of a tensor object is computed once (a launch's checks read each tensor's facts two or
    three times). The memo holds the tensors until the block ends, so no object id is reused meanwhile."""
    if getattr(_MEMO, "facts", None) is not None:  # nested: the outer block owns the memo
        yield
        return
    _MEMO.facts = {}
    try:
        yield
    finally:
        _MEMO.facts = None


def facts(t: torch.Tensor) -> validation.ArrayFacts:
    """:func:`interop.dlpack.facts` (shape, dtype name, itemsize, byte strides, contiguity), memoised per tensor
    inside :func:`facts_once`."""
    memo = getattr(_MEMO, "facts", None)
    if memo is None:
        return dlpack.facts(t)
    hit = memo.get(id(t))
    if hit is None:
        hit = memo[id(t)] = (t, dlpack.facts(t))
    return hit[1]


TORCH_DTYPES = validation.DtypeNames(u8="torch.uint8", i32="torch.int32", i64="torch.int64", int64_pairs=False)
"""SGLang's tensors as torch holds them: int64 as ``torch.int64``."""

CONTEXT_FIELDS = ("canary_buf", "violation_ring", "violation_write_index", "slot_run_counter", "kernel_run_counter")
"""SGLang's ``VerifyOrWriteContext`` tensors (``enable_chain_position_assert`` follows for write launches)."""


def tensor(x: Any, name: str) -> torch.Tensor:
    """``x`` as a torch tensor, without a copy (see :func:`interop.dlpack.as_torch_tensor`).

    Raises:
      TypeError: None or not a tensor / DLPack object.
      ValueError: a consumed DLPack capsule.
    """
    if x is None:
        raise TypeError(f"kv-canary: {name} must be a torch.Tensor, got None")
    return dlpack.as_torch_tensor(x, name=name)


def tensors(obj: Any, fields: Sequence[str], prefix: str = "") -> dict[str, torch.Tensor]:
    """``{prefix + f: tensor}`` for each attribute ``f`` of ``obj`` (see :func:`tensor`)."""
    return {prefix + f: tensor(getattr(obj, f, None), prefix + f) for f in fields}


def check(t: torch.Tensor, name: str, dtype: torch.dtype, shape: Sequence[int | None]) -> None:
    """:func:`canary_jax.contract.validation.check_array` on a torch tensor (messages name torch dtypes)."""
    validation.check_array(facts(t), name, str(dtype), shape)


def check_contiguous(named: dict[str, torch.Tensor], order: Sequence[str] | None = None) -> None:
    """SGLang's ``kv-canary: {name} must be contiguous`` for each tensor, in ``order`` (default: dict order)."""
    for n in named if order is None else order:
        validation.check_contiguous(facts(named[n]), n)


def fields_facts(named: dict[str, torch.Tensor], prefix: str) -> dict[str, validation.ArrayFacts]:
    """Facts keyed by field name (``prefix`` stripped), for the plan checks of :mod:`canary_jax.contract.validation`."""
    return {n[len(prefix) :]: facts(t) for n, t in named.items() if n.startswith(prefix)}


def check_log(ctx: dict[str, torch.Tensor], *, with_flag: bool) -> None:
    """The ring ``int64[R, 8]`` (``R >= 1``), write index ``int32[1]``, the two ``int64[1]`` counters and, for
    write launches, ``enable_chain_position_assert`` ``int32[1]``.

    Raises:
      TypeError / ValueError naming the tensor.
    """
    validation.check_ring(facts(ctx["violation_ring"]), TORCH_DTYPES)
    check(ctx["violation_write_index"], "violation_write_index", torch.int32, (1,))
    check(ctx["slot_run_counter"], "slot_run_counter", torch.int64, (1,))
    check(ctx["kernel_run_counter"], "kernel_run_counter", torch.int64, (1,))
    if with_flag:
        check(ctx["enable_chain_position_assert"], "enable_chain_position_assert", torch.int32, (1,))


def check_devices(named: dict[str, torch.Tensor], ref: str) -> None:
    """Every tensor on ``named[ref]``'s device.

    Raises:
      ValueError: a tensor on another device.
    """
    dev = named[ref].device
    for n, t in named.items():
        if t.device != dev:
            raise ValueError(
                f"kv-canary: {n} must be on {ref}'s device {dev}, got {t.device} (a launch cannot mix devices)"
            )


class LaunchSource(NamedTuple):
    """One real-KV source after its launch checks."""

    owner: torch.Tensor  # the caller's tensor
    u8: torch.Tensor  # its uint8 2-D view, what the launch imports
    meta: tuple[int, int, int]  # (page_size, num_bytes_per_token, read_bytes)


def check_sources(sources: Sequence[Any], *, checked_type: type) -> list[LaunchSource]:
    """SGLang's ``_build_real_kv_source_abi`` checks (every hash mode), once per launch.

    Sources of ``checked_type`` (:class:`interop.sglang_types.RealKvSource`, frozen) had their fields
    checked when they were built; any other object with SGLang's attribute names (SGLang's own dataclasses,
    duck types) gets :func:`canary_jax.contract.validation.check_source_fields` here. Call
    :func:`canary_jax.contract.validation.check_source_count` first.

    Raises:
      ValueError / TypeError: SGLang's field checks, non-contiguous, not 2-D viewed as uint8, not a tensor.
    """
    out = []
    for i, s in enumerate(sources):
        t = tensor(getattr(s, "tensor", None), f"real_kv_sources[{i}].tensor")
        meta = (int(s.page_size), int(s.num_bytes_per_token), int(s.read_bytes))
        f = facts(t)
        if not isinstance(s, checked_type):
            validation.check_source_fields(page_size=meta[0], num_bytes_per_token=meta[1], read_bytes=meta[2], tensor=f)
        validation.check_source_layout(i, f)
        out.append(LaunchSource(t, t.view(torch.uint8), meta))
    return out


def source_args(sources: Sequence[LaunchSource], mode: int) -> tuple[list[TensorArg], tuple]:
    """The launch arguments and static ``(page_size, num_bytes_per_token, read_bytes)`` per source.

    With mode NONE (or no sources) nothing is passed: SGLang never dereferences the sources then. Otherwise
    each row must hold its slots (:func:`canary_jax.contract.validation.check_source_row_width`); which slots each
    source must cover is the launcher's check (:func:`check_coverage`).

    Raises:
      ValueError: a row too narrow for its slot layout (PARTIAL / ALL).
    """
    if mode == int(constants.RealKvHashMode.NONE) or not sources:
        return [], ()
    for s in sources:
        validation.check_source_row_width(int(s.u8.shape[1]), page_size=s.meta[0], num_bytes_per_token=s.meta[1])
    return source_tensor_args([s.owner for s in sources]), tuple(s.meta for s in sources)


def source_tensor_args(tensors: Sequence[torch.Tensor]) -> list[TensorArg]:
    """The launch arguments of the sources' tensors, already checked (by :func:`source_args`, or by an earlier
    launch of the same key, :data:`interop.sglang_launch.CHECKED`): each as its uint8 view, owned by the caller's
    tensor."""
    return [TensorArg(f"real_kv_sources[{i}].tensor", t.view(torch.uint8), False, t) for i, t in enumerate(tensors)]


def check_coverage(
    sources: Sequence[LaunchSource], mode: int, num_slots: int, *, op: str, name: str, hashed: Any
) -> bool:
    """Every slot the launch hashes lies inside every source (:mod:`canary_jax.contract.coverage`); whether the
    check read the launch's slots (then it depends on their values, and must run again at every launch).

    Nothing to check with mode NONE, no sources, or sources that cover the ``num_slots`` slots of the canary buffer.
    Otherwise, outside a CUDA-graph capture ``hashed()`` gives the ``(entries, slots)`` the launch hashes (read on
    the host: a copy of the launch's slot tensors), and a slot past a source is refused; inside a capture, where the
    slots cannot be read, every source must cover the canary buffer.

    Raises:
      ValueError: naming the slot, its entry, the source and its coverage; or, in a capture, the source and the
        canary buffer's slots.
    """
    if mode == int(constants.RealKvHashMode.NONE) or not sources:
        return False
    covs = tuple(coverage.coverage(i, rows=int(s.u8.shape[0]), page_size=s.meta[0]) for i, s in enumerate(sources))
    if not coverage.short(covs, num_slots):
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        coverage.check_whole_buffer(covs, num_slots, why=coverage.TRACED)
        return False
    entries, slots = hashed()
    coverage.check_slots(covs, entries, slots, op=op, name=name)
    return True


def host_int64(t: torch.Tensor) -> np.ndarray:
    """A checked int64 / int32 launch tensor on the host, as numpy int64 (a device copy: coverage checks only)."""
    return t.detach().to("cpu").numpy().astype(np.int64)
