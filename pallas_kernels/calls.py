"""The host side that the verify and write launches share (:mod:`pallas_kernels.verify`,
:mod:`pallas_kernels.write`): the prologue that reads a launch context into kernel operands and statics
(:func:`prologue`), one ``pallas_call`` from named operands with aliased outputs (:func:`call`), and the last
pass of each, which takes the violation log's arrays as operands and puts the updated log back together
(:func:`call_with_log`). Traced under the launchers' ``jax.jit``; nothing here runs on the device by itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax.experimental import pallas as pl

from canary_jax.contract import layout, sources
from canary_jax.planning.plans import VerifyOrWriteContext
from pallas_kernels import refs
from pallas_kernels.config import PallasConfig
from pallas_kernels.hashing import PairHash

LOG_OUTPUTS = ("ring", "write_index", "slot_counters", "kernel_counters")
"""Names of the log operands a launch's last pass updates in place, in operand (and output) order."""


class Prologue(NamedTuple):
    """A launch context read into kernel operands and statics.

    Fields:
      descs: the real-KV source descriptors (:func:`canary_jax.contract.sources.source_descriptors`), static.
      tag: the launch tag (``int(context.kernel_kind)``), static.
      counter_row: the row of the log's counter arrays this launch bumps, static: ``tag``, or 0 where the arrays
        have one row (the torch launchers pass SGLang's per-tag counter views as they are; the public entry points
        refuse counter arrays without a row for the tag before any kernel is traced).
      log: the context's :class:`~canary_jax.contract.layout.ViolationLog`.
      words: ``uint32[N, S/4]`` the canary buffer as words (:func:`canary_jax.contract.layout.canary_words`).
      n_slots: ``N``, static.
      hasher: the :class:`~pallas_kernels.hashing.PairHash` of the config's multiplier for this mode.
      srcs: per described source, its ``uint32`` word view (:func:`canary_jax.contract.sources.source_words`).
    """

    descs: tuple
    tag: int
    counter_row: int
    log: layout.ViolationLog
    words: jax.Array
    n_slots: int
    hasher: PairHash
    srcs: list


def counter_row(context: VerifyOrWriteContext) -> int:
    """The row of the context's counter arrays a launch bumps: the tag, or 0 for one-row arrays (SGLang's per-tag
    views, as the torch launchers pass them; the public entry points refuse arrays without a row for the tag)."""
    return int(context.kernel_kind) if context.log.kernel_run_counters.shape[0] > 1 else 0


def prologue(context: VerifyOrWriteContext, config: PallasConfig, interpret: bool) -> Prologue:
    """The operands and statics every verify and write launch starts from (the sources past the descriptors'
    count, which the hash mode leaves unread, are dropped).

    Raises:
      NotImplementedError: ``config.multiplier == "asm"`` with ``interpret=True``.
    """
    descs = sources.source_descriptors(context.real_kv_sources, context.real_kv_hash_mode)
    words = layout.canary_words(context.canary_buf)
    hasher = PairHash(config.resolved_multiplier(interpret))
    tensors = [s.tensor for s in context.real_kv_sources][: len(descs)]
    return Prologue(
        descs=descs,
        tag=int(context.kernel_kind),
        counter_row=counter_row(context),
        log=context.log,
        words=words,
        n_slots=int(words.shape[0]),
        hasher=hasher,
        srcs=[sources.source_words(t) for t in tensors],
    )


def call(
    kernel: Callable,
    args: dict[str, Any],
    out_shape: dict[str, Any] | Sequence[str],
    *,
    grid: tuple[int, ...],
    compiler_params: Any,
    interpret: bool,
    name: str,
):
    """``pl.pallas_call(kernel, ...)(*args.values())``.

    Args:
      kernel: the kernel, its statics bound.
      args: the operands by name, in call order.
      out_shape: the outputs by name: a dict of ``jax.ShapeDtypeStruct``, or names of operands whose shape and
        dtype the outputs take. An output named as an operand aliases it (:func:`pallas_kernels.refs.aliases`).
      grid, compiler_params, interpret, name: as ``pl.pallas_call``.

    Returns:
      The tuple of outputs, in ``out_shape``'s order.
    """
    if not isinstance(out_shape, dict):
        out_shape = {k: jax.ShapeDtypeStruct(args[k].shape, args[k].dtype) for k in out_shape}
    return pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape.values()),
        grid=grid,
        input_output_aliases=refs.aliases(args, tuple(out_shape)),
        compiler_params=compiler_params,
        interpret=interpret,
        name=name,
    )(*args.values())


def call_with_log(
    kernel: Callable,
    args: dict[str, Any],
    log: layout.ViolationLog,
    *,
    outs: Sequence[str] = (),
    scratch: dict[str, jax.ShapeDtypeStruct] | None = None,
    grid: tuple[int, ...],
    compiler_params: Any,
    interpret: bool,
    name: str,
) -> tuple[list, layout.ViolationLog]:
    """A launch's last pass: :func:`call` with the log's ring, write index and counters appended to ``args``
    (:func:`pallas_kernels.refs.log_operands`) and updated in place, ``ring_capacity`` (the ring's rows) bound.

    Args:
      kernel: the kernel, its other statics bound; it takes ``ring_capacity``.
      args: the other operands by name, in call order (the log's come after them).
      log: the launch's violation log.
      outs: names of operands in ``args`` that the pass also updates in place (before the log's outputs).
      scratch: fresh outputs by name (after ``outs``, before the log's): buffers the launch writes and reads
        itself, uninitialised at the start.
      grid, compiler_params, interpret, name: as ``pl.pallas_call``.

    Returns:
      ``(the outputs named by outs and scratch, the new log)``.
    """
    ring, slot_counters, kernel_counters = refs.log_operands(log)
    args = dict(
        args, ring=ring, write_index=log.write_index, slot_counters=slot_counters, kernel_counters=kernel_counters
    )
    out_shape = {k: jax.ShapeDtypeStruct(args[k].shape, args[k].dtype) for k in (*outs, *LOG_OUTPUTS)}
    out_shape = {**{k: out_shape[k] for k in outs}, **(scratch or {}), **{k: out_shape[k] for k in LOG_OUTPUTS}}
    *updated, ring, wi, slot_counters, kernel_counters = call(
        functools.partial(kernel, ring_capacity=ring.shape[0]),
        args,
        out_shape,
        grid=grid,
        compiler_params=compiler_params,
        interpret=interpret,
        name=name,
    )
    new_log = refs.updated_log(
        log, ring=ring, write_index=wi, slot_counters=slot_counters, kernel_counters=kernel_counters
    )
    return updated, new_log
