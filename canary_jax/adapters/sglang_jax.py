"""The canary batch of an sglang-jax forward batch (:func:`from_sglang_jax`, :func:`from_sglang_jax_batch`).

sglang-jax's ``ForwardBatch`` speaks SGLang's vocabulary with rows from 0 (padding -1), a ragged ``cache_loc``
instead of ``req_to_token`` (which stays on the host) and no prefix / extend lengths in decode batches; this
module maps those away (see :func:`from_sglang_jax`) and reads ``cache_loc`` through a
:class:`~canary_jax.planning.slot_tables.RaggedSlotTable`. Re-exported by :mod:`canary_jax.adapters.batches`, whose
docstring gives the conventions side by side.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from canary_jax.adapters.batch_fields import (
    _expected_inputs,
    _expected_tokens,
    _host,
    _ints,
    _prechecked_batch,
    _table,
    _where_pairs,
)
from canary_jax.contract import ints, pairs
from canary_jax.planning.slot_reads import _unchecked
from canary_jax.planning.slot_tables import RaggedSlotTable
from canary_jax.runtime.endpoints import ExpectedInputs
from canary_jax.runtime.state import CanaryBatch

__all__ = ["from_sglang_jax", "from_sglang_jax_batch"]

_DECODE_MODES = ("DECODE", "IDLE")
_EXTEND_MODES = ("EXTEND", "MIXED")
_SGLANG_JAX_FIELDS = (
    "forward_mode",
    "input_ids",
    "positions",
    "out_cache_loc",
    "req_pool_indices",
    "seq_lens",
    "cache_loc",
    "extend_prefix_lens",
    "extend_seq_lens",
)


def _check_cache_loc_spans(who, rpi, seq, n_cache_loc: int, page: int) -> None:
    """The live rows' spans fit ``cache_loc`` (host fields only; see :func:`from_sglang_jax`, Raises)."""
    if rpi is None or seq is None:
        return
    start = 0
    for r, (row, n) in enumerate(zip(rpi.tolist(), seq.tolist())):
        n = max(int(n), 0)
        if row >= 0 and start + n > n_cache_loc:
            raise ValueError(
                f"kv-canary: {who}: cache_loc has {n_cache_loc} entries but row {r} (seq_lens[{r}] = {n}) reads "
                f"cache_loc[{start}:{start + n}] (spans of the rows' seq_lens, in row order, each padded to "
                f"cache_loc_page_size={page})"
            )
        start += -(-n // page) * page


def _mode_name(forward_mode: Any) -> str:
    name = getattr(forward_mode, "name", forward_mode)
    if not isinstance(name, str):
        raise TypeError(
            f"kv-canary: from_sglang_jax: forward_mode must be a ForwardMode or a str, got {forward_mode!r}"
        )
    name = name.upper()
    if name not in _DECODE_MODES + _EXTEND_MODES:
        raise NotImplementedError(f"kv-canary: Unsupported forward mode for kv-canary: {name}")
    return name


@functools.partial(jax.jit, static_argnames=("decode", "page_size"))
def _sglang_jax_rows(rpi, seq_lens, prefix, extend, *, decode: bool, page_size: int):
    """Per-row fields of an sglang-jax batch (all ``uint32[bs, 2]`` pairs)."""
    bs = rpi.shape[0]
    live = ~pairs.is_negative(pairs.unpack(rpi))  # sglang-jax pads rows with -1
    seq = pairs.unpack(seq_lens)
    one = pairs.const(1, (bs,))
    if decode:
        extend = pairs.pack(one)
        prefix = pairs.pack(pairs.sub(seq, one))
    elif prefix is None:
        prefix = pairs.pack(pairs.sub(seq, pairs.unpack(extend)))
    canary_rpi = _where_pairs(live, pairs.pack(pairs.add(pairs.unpack(rpi), 1)), 0)
    # cache_loc holds each row's seq_lens slots, the span padded up to a multiple of the page size
    # (get_model_worker_batch). A length that does not fit int32 saturates: its span could not fit cache_loc
    # (< 2**31 entries) anyway, so every read of it is out of range either way.
    n = jnp.where(pairs.is_negative(seq), 0, pairs.clamp(seq, ints.INT32_MAX - page_size))
    aligned = (n + (page_size - 1)) // page_size * page_size
    starts = pairs.sub(pairs.cumsum(pairs.from_int32(aligned)), pairs.from_int32(aligned))
    return canary_rpi, _where_pairs(live, prefix, 0), _where_pairs(live, extend, 0), pairs.pack(starts)


def from_sglang_jax(
    *,
    forward_mode: Any,
    input_ids: Any,
    positions: Any,
    out_cache_loc: Any,
    req_pool_indices: Any,
    seq_lens: Any,
    cache_loc: Any,
    extend_prefix_lens: Any = None,
    extend_seq_lens: Any = None,
    cache_loc_page_size: int = 1,
    expected_inputs: ExpectedInputs | None = None,
    expected_tokens: Any = None,
    expected_tokens_valid_lens: Any = None,
) -> CanaryBatch:
    """The canary batch of an sglang-jax forward batch (``sgl_jax/srt/model_executor/forward_batch_info.py``
    ``ForwardBatch``, filled by ``sgl_jax/srt/managers/schedule_batch.py`` ``get_model_worker_batch``).

    sglang-jax speaks SGLang's vocabulary with three differences this maps away:

    * request rows start at 0 (``ReqToTokenPool.free_slots = range(size)``) and padding rows are -1, while the
      canary's padding row is 0: the canary row is ``req_pool_indices + 1`` (0 for rows < 0);
    * ``req_to_token`` stays on the host and the batch carries ``cache_loc``, each row's
      ``req_to_token[req_pool_indices[r], :seq_lens[r]]`` concatenated in row order, each span padded to a
      multiple of ``cache_loc_page_size``: read through a :class:`~canary_jax.planning.slot_tables.RaggedSlotTable`;
    * decode batches carry no prefix / extend lengths: prefix ``seq_lens - 1``, extend 1 (SGLang's decode
      prefix is the position, the same number).

    Jit-able (fixed shapes, jnp only); called eagerly it runs one small jitted program per shape set.

    Args:
      forward_mode: sglang-jax's ``ForwardMode`` (or its name): EXTEND / MIXED use the extend lengths,
        DECODE / IDLE one token per row.
      input_ids, positions: int64-valued ``[T]`` (padding tokens: any value).
      out_cache_loc: int64-valued ``[T]`` slots written this step; -1 = padding token (never written).
      req_pool_indices: int64-valued ``[bs]`` ``req_to_token`` rows; -1 = padding row (after the real rows).
      seq_lens: int64-valued ``[bs]`` tokens in the KV after this step (0 on padding rows).
      cache_loc: ``int32[N]`` ragged slots (see above); tail past the last span unspecified.
      extend_prefix_lens: int64-valued ``[bs]`` (EXTEND / MIXED); None: ``seq_lens - extend_seq_lens``.
      extend_seq_lens: int64-valued ``[bs]``: required for EXTEND / MIXED (sglang-jax leaves it None in MIXED
        batches: pass the schedule batch's ``extend_lens``).
      cache_loc_page_size: the page size ``cache_loc`` spans are aligned to (1 for unaligned versions).
      expected_inputs: ExpectedInputs (int64-valued ``[T]`` tokens, positions) for the write input assert.
      expected_tokens: ``int32[max_reqs, max_context_len]`` expected token ids per ``req_to_token`` row
        (sglang-jax's 0-based rows) for the verify-token assert, with ``expected_tokens_valid_lens``
        (int64-valued ``[bs]``); both or neither.

    Returns:
      A :class:`~canary_jax.runtime.state.CanaryBatch` for :func:`~canary_jax.runtime.step.canary_plan` /
      ``canary_head`` / ``canary_tail`` / ``canary_step`` whose ``req_to_token`` is a RaggedSlotTable (build it
      with this function again rather than ``CanaryBatch.replace``).

    Raises:
      ValueError / TypeError: a field of the wrong rank, dtype or length (naming it, its shape and the expected
        one), a missing field the mode needs, ``cache_loc_page_size <= 0``; with host ``req_pool_indices`` and
        ``seq_lens``, a ``cache_loc`` shorter than the live rows' spans need (naming the row and the span);
        before tracing. With those fields on the device the span is the caller's contract: a read past
        ``cache_loc`` gives slot 0 (verify skips it, so that position is not checked).
      NotImplementedError: TARGET_VERIFY, DRAFT_EXTEND and other modes (SGLang's message).
    """
    who = "from_sglang_jax"
    mode = _mode_name(forward_mode)
    page = ints.check_int(cache_loc_page_size, name=f"{who}: cache_loc_page_size", minimum=1, maximum=2**20)
    rpi = _ints(req_pool_indices, who, "req_pool_indices", None, "[bs]")
    bs = int(rpi.shape[0])
    seq = _ints(seq_lens, who, "seq_lens", bs, "[bs]")
    ids = _ints(input_ids, who, "input_ids", None, "[num_tokens]")
    t = int(ids.shape[0])
    pos = _ints(positions, who, "positions", t, "[num_tokens]")
    loc = _ints(out_cache_loc, who, "out_cache_loc", t, "[num_tokens]")
    cl = _table(cache_loc, who, "cache_loc", 1, "[N]")
    if int(cl.shape[0]) >= ints.INT32_MAX:
        raise ValueError(f"kv-canary: {who}: cache_loc length {cl.shape[0]} is too large")
    decode = mode in _DECODE_MODES
    prefix = extend = None
    if not decode:
        extend = _ints(extend_seq_lens, who, f"extend_seq_lens ({mode} batches)", bs, "[bs]")
        if extend_prefix_lens is not None:
            prefix = _ints(extend_prefix_lens, who, "extend_prefix_lens", bs, "[bs]")
    ex = _expected_inputs(expected_inputs, who, t)
    pool, valid = _expected_tokens(expected_tokens, expected_tokens_valid_lens, rpi, who, bs)
    _check_cache_loc_spans(
        who, _host(req_pool_indices, "req_pool_indices"), _host(seq_lens, "seq_lens"), int(cl.shape[0]), page
    )

    canary_rpi, prefix, extend, starts = _sglang_jax_rows(rpi, seq, prefix, extend, decode=decode, page_size=page)
    table = _unchecked(RaggedSlotTable, cache_loc=cl, row_starts=starts, row_lens=seq)
    # the token arrays' pairs are their widening as given: the launches may read them as they are
    passed = dict(input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc)
    return _prechecked_batch((canary_rpi, prefix, extend), ids, pos, loc, table, ex, (pool, valid), passed)


def from_sglang_jax_batch(forward_batch: Any, **kw) -> CanaryBatch:
    """:func:`from_sglang_jax` reading the fields of an sglang-jax ``ForwardBatch`` / ``ModelWorkerBatch``
    (``forward_mode``, ``input_ids``, ``positions``, ``out_cache_loc``, ``req_pool_indices``, ``seq_lens``,
    ``cache_loc``, ``extend_prefix_lens``, ``extend_seq_lens``); keywords override or add fields
    (``cache_loc_page_size``, ``extend_seq_lens`` for MIXED, the expected inputs / tokens).

    Raises:
      As :func:`from_sglang_jax`; a missing attribute reads as None.
    """
    fields = {name: getattr(forward_batch, name, None) for name in _SGLANG_JAX_FIELDS}
    fields.update(kw)
    return from_sglang_jax(**fields)
