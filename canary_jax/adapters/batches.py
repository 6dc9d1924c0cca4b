"""Canary batches from the batch conventions of JAX serving stacks, built on the device inside the step.

The step API (:mod:`canary_jax.runtime.step`) reads a :class:`~canary_jax.runtime.state.CanaryBatch` in SGLang's
vocabulary: per request row ``req_pool_indices`` (0 = padding row), ``prefix_lens`` (tokens already in the KV),
``extend_seq_lens`` (tokens written this step); per token ``input_ids``, ``positions``, ``out_cache_loc`` (the
slot written; < 0 = no write); and where each (request, position) lives. Other stacks say the same things
differently. The functions here translate, with jnp only (jit-able, no host sync, fixed shapes), and give the
plan builder a :class:`~canary_jax.slot_tables.SlotTable` over the stack's own layout instead of a dense
``req_to_token``, so the plans are byte-identical to those SGLang's builder makes for the same logical batch
and the work stays proportional to the planned entries.

=====================  ========================================================  ==================================
convention             the stack's batch                                         canary batch
=====================  ========================================================  ==================================
sglang-jax             ``ForwardBatch``: ``req_pool_indices`` (rows from 0;      ``req_pool_indices + 1`` (0 =
:func:`from_sglang_    padding -1), ``seq_lens`` (after the step; padding 0),    padding), prefix / extend as SGLang
jax`                   ``extend_prefix_lens`` / ``extend_seq_lens`` (EXTEND),    (decode: ``seq_lens - 1`` / 1), a
                       decode prefix ``seq_lens - 1``; ``out_cache_loc``         :class:`RaggedSlotTable` over
                       (padding -1); ragged ``cache_loc`` (``req_to_token``      ``cache_loc``
                       stays on the host)
vLLM-style             ``block_table`` ``[num_rows, max_blocks]``, ``block_      ``row + 1`` for rows < num_reqs,
:func:`from_block_     size``, ``seq_lens`` (after the step),                    prefix ``seq_lens - query_len``,
tables`                ``query_start_loc`` ``[num_rows + 1]``, ``num_reqs``      a :class:`BlockTable` computing
                       (rows past it padding), ``slot_mapping`` (optional;       ``bt[r, p // bs] * bs + p % bs``
                       padding -1), ``input_ids``, ``positions``                 in the gather
=====================  ========================================================  ==================================

Rows may move between steps (vLLM condenses and reorders its persistent batch; sglang-jax reuses
``req_to_token`` rows). Nothing the canary keeps is keyed by a row: the canary buffers are keyed by KV slot,
and within one step the rows only say which table row and expected-token row to read. So a request read from a
new row next step is checked exactly as before.

Errors: every field is checked before anything is traced; a wrong rank, dtype or length raises a ``ValueError``
or ``TypeError`` naming the function, the field, its shape and what was expected. Fields given as host data
(numpy, lists) also have their *values* checked (each function's Raises says which), naming the field, the
index, the value and the limit. Fields given as JAX arrays (and everything inside a ``jit``) are never read on
the host: their values are the caller's contract, and each function says what the plans then do.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax import ints, pairs
from canary_jax.plan_builder import build_plans
from canary_jax.plans import VerifyPlan
from canary_jax.runtime.endpoints import ExpectedInputs
from canary_jax.runtime.state import CanaryBatch
from canary_jax.slot_tables import (
    BlockTable,
    ExpectedTokenTable,
    GroupSlotTables,
    RaggedSlotTable,
    SlotTable,
)

__all__ = [
    "from_block_tables",
    "from_sglang_jax",
    "from_sglang_jax_batch",
    "sweep_plan_after_step",
    "update_swa_lut",
]

_INT32_MAX = 2**31 - 1
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


# --- static checks ---------------------------------------------------------------------------------------
def _dtype(x: Any) -> np.dtype:
    dt = getattr(x, "dtype", None)
    return np.dtype(np.asarray(x).dtype if dt is None else dt)


def _describe(x: Any) -> str:
    return f"shape {tuple(np.shape(x))} dtype {_dtype(x)}"


def _ints(x: Any, who: str, name: str, length: int | None, dims: str) -> Any:
    """An int64-valued 1-D field as exact ``uint32[n, 2]`` pairs (JAX), checked before tracing.

    Raises:
      ValueError: ``x`` is None, not 1-D, or not ``length`` long.
      TypeError: not integer data.
    """
    if x is None:
        raise ValueError(f"kv-canary: {who}: {name} is required (an integer array {dims})")
    shape = tuple(np.shape(x))
    dt = _dtype(x)
    if dt.kind not in "iu":
        raise TypeError(f"kv-canary: {who}: {name} must be an integer array {dims}, got {_describe(x)}")
    if len(shape) != 1:
        raise ValueError(f"kv-canary: {who}: {name} must be a 1-D integer array {dims}, got {_describe(x)}")
    if length is not None and shape[0] != length:
        raise ValueError(f"kv-canary: {who}: {name} must have shape ({length},) {dims}, got {_describe(x)}")
    return ints.as_int64_pairs(x, name=f"{who}: {name}", shape=(shape[0],))


def _table(x: Any, who: str, name: str, ndim: int, dims: str, min_rows: int | None = None) -> jax.Array:
    """An int32 table (``req_to_token``-like) of rank ``ndim``, checked before tracing.

    Raises:
      ValueError: wrong rank, too few rows, or numpy values outside int32.
      TypeError: a JAX array that is not int32, or non-integer data.
    """
    if x is None:
        raise ValueError(f"kv-canary: {who}: {name} is required (an int32 array {dims})")
    shape = tuple(np.shape(x))
    if len(shape) != ndim:
        raise ValueError(f"kv-canary: {who}: {name} must be a {ndim}-D int32 array {dims}, got {_describe(x)}")
    dt = _dtype(x)
    if dt.kind not in "iu" or (isinstance(x, jax.Array) and dt != np.dtype(np.int32)):
        raise TypeError(f"kv-canary: {who}: {name} must be a {ndim}-D int32 array {dims}, got {_describe(x)}")
    if min_rows is not None and shape[0] < min_rows:
        raise ValueError(f"kv-canary: {who}: {name} must have at least {min_rows} rows {dims}, got {_describe(x)}")
    return ints.as_int32(x, name=f"{who}: {name}")


def _expected_inputs(ex: Any, who: str, t: int) -> ExpectedInputs | None:
    if ex is None:
        return None
    if not isinstance(ex, ExpectedInputs):
        raise TypeError(f"kv-canary: {who}: expected_inputs must be an ExpectedInputs, got {type(ex).__name__}")
    return ExpectedInputs(
        tokens=_ints(ex.tokens, who, "expected_inputs.tokens", t, "[num_tokens]"),
        positions=_ints(ex.positions, who, "expected_inputs.positions", t, "[num_tokens]"),
    )


def _expected_tokens(tokens: Any, valid_lens: Any, row_index: Any, who: str, bs: int):
    """``(ExpectedTokenTable, valid_lens pairs)`` or ``(None, None)``; both or neither must be given."""
    if tokens is None and valid_lens is None:
        return None, None
    if tokens is None or valid_lens is None:
        raise ValueError(f"kv-canary: {who}: expected_tokens and expected_tokens_valid_lens go together")
    table = _table(tokens, who, "expected_tokens", 2, "[rows, max_context_len]")
    valid = _ints(valid_lens, who, "expected_tokens_valid_lens", bs, "[num_rows]")
    return ExpectedTokenTable(tokens=table, row_index=row_index), valid


def _host(x: Any, name: str) -> np.ndarray | None:
    """A checked integer field's exact int64 values when it is host data (numpy, lists), else None: JAX
    arrays and tracers are never read on the host (no sync); their values are the caller's contract."""
    if x is None or isinstance(x, jax.Array):
        return None
    return ints.exact_int64_np(x, name=name)


def _host_num_reqs(num_reqs: Any, rows: int) -> int | None:
    """The live row count when it is known on the host (an int, numpy, or None = every row), else None."""
    if num_reqs is None:
        return rows
    if isinstance(num_reqs, jax.Array):
        return None
    return int(np.asarray(num_reqs).reshape(()))


def _check_block_table_values(who, qsl, seq, bt, swa_bt, t, n, bsz, null_block) -> None:
    """Value checks of a vLLM-style batch's host fields (see :func:`from_block_tables`, Raises)."""
    if qsl is None or n is None:
        return
    for r in range(n):
        if qsl[r + 1] < qsl[r]:
            raise ValueError(
                f"kv-canary: {who}: query_start_loc must be non-decreasing over the {n} live rows (num_reqs), got "
                f"query_start_loc[{r + 1}] = {int(qsl[r + 1])} < query_start_loc[{r}] = {int(qsl[r])}"
            )
    if qsl[n] > t:
        raise ValueError(
            f"kv-canary: {who}: query_start_loc[{n}] = {int(qsl[n])} (the end of the {n} live rows' new tokens, "
            f"num_reqs = {n}) is past the {t} tokens of input_ids"
        )
    if seq is None:
        return
    for r in range(n):
        q = int(qsl[r + 1] - qsl[r])
        if seq[r] < q:
            raise ValueError(
                f"kv-canary: {who}: seq_lens[{r}] = {int(seq[r])} is smaller than row {r}'s {q} new tokens "
                f"(query_start_loc[{r + 1}] - query_start_loc[{r}]); seq_lens counts the KV tokens after the step, "
                "so its prefix would be negative"
            )
    for name, table in (("block_table", bt), ("swa_block_table", swa_bt)):
        if table is None:
            continue
        for r in range(n):
            used = table[r, : min(-(-int(seq[r]) // bsz), table.shape[1])]
            bad = np.flatnonzero((used < 0) if null_block is None else ((used < 0) & (used != null_block)))
            if bad.size:
                j = int(bad[0])
                raise ValueError(
                    f"kv-canary: {who}: {name}[{r}, {j}] = {int(used[j])} is a negative block id in a block row {r} "
                    f"reads (null_block={null_block}); pass null_block={int(used[j])} if it means no block"
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


def _num_reqs(num_reqs: Any, rows: int, who: str) -> jax.Array:
    """``num_reqs`` as an ``int32[]`` device scalar (data, so each count shares one program); a device value
    outside ``[0, rows]`` is clipped (host values are checked)."""
    if num_reqs is None:
        return jnp.int32(rows)
    if isinstance(num_reqs, (jax.Array, np.ndarray)):
        if num_reqs.shape not in ((), (1,)) or _dtype(num_reqs).kind not in "iu":
            raise ValueError(
                f"kv-canary: {who}: num_reqs must be an int or an integer array of shape () or (1,), got "
                f"{_describe(num_reqs)}"
            )
        if isinstance(num_reqs, jax.Array):
            return jnp.clip(num_reqs.reshape(()), 0, rows).astype(jnp.int32)
        num_reqs = num_reqs.reshape(()).item()
    n = ints.check_int(num_reqs, name=f"{who}: num_reqs", minimum=0, maximum=rows)
    return jnp.int32(n)


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


# --- traced bodies ---------------------------------------------------------------------------------------
def _where_pairs(pred: jax.Array, a: jax.Array, b: int | jax.Array) -> jax.Array:
    if isinstance(b, int):
        b = pairs.pack(pairs.const(b, pred.shape))
    return jnp.where(pred[..., None], a, b)


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
    n = jnp.where(pairs.is_negative(seq), 0, pairs.clamp(seq, _INT32_MAX - page_size))
    aligned = (n + (page_size - 1)) // page_size * page_size
    starts = pairs.sub(pairs.cumsum(pairs.from_int32(aligned)), pairs.from_int32(aligned))
    return canary_rpi, _where_pairs(live, prefix, 0), _where_pairs(live, extend, 0), pairs.pack(starts)


@jax.jit
def _block_table_rows(qsl, seq_lens, num_reqs):
    """Per-row fields of a vLLM-style batch: canary rpi, prefix, extend (``uint32[num_rows, 2]`` pairs)."""
    rows = seq_lens.shape[0]
    r = jnp.arange(rows, dtype=jnp.int32)
    live = r < num_reqs
    q = pairs.unpack(qsl)
    query_len = pairs.sub(pairs.U64(q.lo[1:], q.hi[1:]), pairs.U64(q.lo[:-1], q.hi[:-1]))
    extend = _where_pairs(live, pairs.pack(query_len), 0)
    prefix = _where_pairs(live, pairs.pack(pairs.sub(pairs.unpack(seq_lens), pairs.unpack(extend))), 0)
    rpi = _where_pairs(live, pairs.pack(pairs.from_int32(r + 1)), 0)
    return rpi, prefix, extend


def _token_slots(qsl, prefix, rpi, num_reqs, num_tokens: int, table: SlotTable) -> jax.Array:
    """The slot each of the ``num_tokens`` tokens writes, from the table (``uint32[T, 2]``; -1 past the live
    tokens): token ``t`` of row ``r`` (``qsl[r] <= t < qsl[r + 1]``) is position ``prefix[r] + t - qsl[r]``,
    where tpu-inference's ragged paged attention writes its KV (it has no slot_mapping)."""
    rows = prefix.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    if rows == 0 or num_tokens == 0:
        return pairs.pack(pairs.const(-1, (num_tokens,)))
    r = jnp.arange(rows, dtype=jnp.int32)
    q = pairs.unpack(qsl)
    ends = jnp.where(r < num_reqs, pairs.clamp(pairs.U64(q.lo[1:], q.hi[1:]), num_tokens), num_tokens)
    row = jnp.clip(jnp.searchsorted(ends, t, side="right", method="scan_unrolled").astype(jnp.int32), 0, rows - 1)
    start = pairs.U64(q.lo[row], q.hi[row])
    pos = pairs.add(pairs.unpack(prefix[row]), pairs.sub(pairs.from_int32(t), start))
    slot = table.lookup(row, rpi[row], pairs.pack(pos))
    n_live = pairs.U64(q.lo[num_reqs], q.hi[num_reqs])
    return _where_pairs(pairs.lt(pairs.from_int32(t), n_live), slot, -1)


@functools.partial(jax.jit, static_argnames=("num_tokens",))
def _vllm_out_cache_loc(qsl, prefix, rpi, num_reqs, slot_mapping, table, *, num_tokens: int):
    if slot_mapping is None:
        return _token_slots(qsl, prefix, rpi, num_reqs, num_tokens, table)
    q = pairs.unpack(qsl)
    n_live = pairs.U64(q.lo[num_reqs], q.hi[num_reqs])
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    return _where_pairs(pairs.lt(pairs.from_int32(t), n_live), slot_mapping, -1)


# --- public API ------------------------------------------------------------------------------------------
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
      multiple of ``cache_loc_page_size``: read through a :class:`~canary_jax.slot_tables.RaggedSlotTable`;
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
    if int(cl.shape[0]) >= _INT32_MAX:
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
    return CanaryBatch.prechecked(
        req_pool_indices=canary_rpi,
        prefix_lens=prefix,
        extend_seq_lens=extend,
        input_ids=ids,
        positions=pos,
        out_cache_loc=loc,
        req_to_token=table,
        expected_inputs=ex,
        req_to_verify_expected_tokens=pool,
        req_to_verify_expected_tokens_valid_lens=valid,
    )


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


def from_block_tables(
    *,
    input_ids: Any,
    positions: Any,
    query_start_loc: Any,
    seq_lens: Any,
    block_table: Any,
    block_size: int,
    num_reqs: Any = None,
    slot_mapping: Any = None,
    swa_block_table: Any = None,
    null_block: int | None = 0,
    expected_inputs: ExpectedInputs | None = None,
    expected_tokens: Any = None,
    expected_tokens_valid_lens: Any = None,
) -> CanaryBatch:
    """The canary batch of a vLLM-style batch: block tables, ``query_start_loc``, ``seq_lens``.

    The convention of vLLM (``vllm/v1/attention/backends/utils.py`` ``CommonAttentionMetadata``: padding slots
    ``PAD_SLOT_ID = -1``; ``vllm/v1/core/block_pool.py``: block 0 is the null block), tpu-inference
    (``tpu_inference/layers/common/attention_metadata.py`` ``AttentionMetadata``; ``tpu_inference/runner/
    tpu_runner.py`` ``_prepare_inputs`` pads ``seq_lens`` with 0 and ``query_start_loc`` past ``num_reqs`` with
    1, and keeps ``block_tables`` flat: reshape it to ``[max_num_reqs, -1]``) and EasyDeL eSurge
    (``RaggedPagesMetadata``: ``pages_tables``, ``context_lens``, ``query_start_loc``, ``num_seqs``,
    ``page_size``). Per row ``r < num_reqs``: extend ``E = query_start_loc[r + 1] - query_start_loc[r]``,
    prefix ``seq_lens[r] - E``, canary row ``r + 1``; rows from ``num_reqs`` on are padding (canary row 0).
    Slots come from the block table in the gather (:class:`~canary_jax.slot_tables.BlockTable`); no
    ``req_to_token`` is built. Rows are this step's batch rows: a request may sit in another row next step.

    Jit-able (fixed shapes, jnp only; ``num_reqs`` may be a device scalar); called eagerly it runs small jitted
    programs, one per shape set.

    Args:
      input_ids, positions: int64-valued ``[T]``; tokens ``t >= query_start_loc[num_reqs]`` are padding.
      query_start_loc: int64-valued ``[num_rows + 1]`` cumulative new-token offsets (``[0] == 0``,
        non-decreasing over the live rows; values past ``num_reqs`` are ignored).
      seq_lens: int64-valued ``[num_rows]`` tokens in the KV after this step.
      block_table: ``int32[>= num_rows, max_blocks_per_req]`` physical block ids of each batch row.
      block_size: tokens per block (static).
      num_reqs: live rows: an int, or an integer array of shape () or (1,) (a device value is data: one program
        serves every count; outside ``[0, num_rows]`` it is clipped); None: every row.
      slot_mapping: int64-valued ``[T]`` slot each token writes (vLLM's; padding entries ignored), or None to
        compute it from the block table at position ``prefix + (t - query_start_loc[r])`` (where
        tpu-inference's ragged paged attention writes).
      swa_block_table: ``int32[>= num_rows, max_blocks]`` block table of the sliding-window KV-cache group (its
        blocks index the SWA pool), read for SWA canary groups instead of the LUT (see
        :class:`~canary_jax.slot_tables.GroupSlotTables` and :func:`update_swa_lut`); None: SWA groups, if
        any, translate the full table through their LUT.
      null_block: the "no block" id, read as slot 0 (skipped by verify, like an evicted slot); None: none.
      expected_inputs: ExpectedInputs (int64-valued ``[T]``) for the write input assert.
      expected_tokens: ``int32[>= num_rows, max_model_len]`` token ids of each batch row (vLLM's
        ``InputBatch.token_ids_cpu``) for the verify-token assert, with ``expected_tokens_valid_lens``
        (int64-valued ``[num_rows]``: ``num_tokens`` per row); both or neither.

    Returns:
      A :class:`~canary_jax.runtime.state.CanaryBatch` (``num_rows`` rows, so ``num_rows <=
      write_req_capacity``) whose ``req_to_token`` is a BlockTable (or GroupSlotTables); build it with this
      function again rather than ``CanaryBatch.replace``.

    Raises:
      ValueError / TypeError: a field of the wrong rank, dtype or length (naming it, its shape and the expected
        one), ``block_size <= 0``, ``num_reqs`` outside ``[0, num_rows]``; with host ``query_start_loc`` (and
        ``num_reqs`` an int, numpy or None): ``query_start_loc`` decreasing over the live rows or ending past
        the tokens, and with host ``seq_lens`` too, a live row's ``seq_lens`` below its new-token count (a
        negative prefix), or a negative block id other than ``null_block`` in the blocks a live row reads
        (of a host ``block_table`` / ``swa_block_table``); all before tracing. On the device these are the
        caller's contract: a negative prefix verifies nothing and restarts the row's chain at the anchor, and a
        negative block id gives negative slots (verify reads them as empty records and flags them; writes skip
        them).
    """
    who = "from_block_tables"
    seq = _ints(seq_lens, who, "seq_lens", None, "[num_rows]")
    rows = int(seq.shape[0])
    qsl = _ints(query_start_loc, who, "query_start_loc", None, "[num_rows + 1]")
    if int(qsl.shape[0]) != rows + 1:
        bt_shape = tuple(np.shape(block_table)) if block_table is not None else ()
        if len(bt_shape) == 2 and bt_shape[0] == int(qsl.shape[0]) - 1:  # the block table sides with qsl
            raise ValueError(
                f"kv-canary: {who}: seq_lens must have shape ({bt_shape[0]},) [num_rows], got {_describe(seq_lens)} "
                f"(query_start_loc has {qsl.shape[0]} entries and block_table {bt_shape[0]} rows)"
            )
        raise ValueError(
            f"kv-canary: {who}: query_start_loc must have shape ({rows + 1},) [num_rows + 1], got "
            f"{_describe(query_start_loc)} (seq_lens has {rows} rows)"
        )
    ids = _ints(input_ids, who, "input_ids", None, "[num_tokens]")
    t = int(ids.shape[0])
    pos = _ints(positions, who, "positions", t, "[num_tokens]")
    bsz = ints.check_int(block_size, name=f"{who}: block_size")
    if bsz <= 0:
        raise ValueError(f"kv-canary: {who}: block_size must be positive, got {bsz}")
    dims = "[num_rows, max_blocks_per_req]"
    hint = " (tpu-inference keeps block_tables flat: reshape it to [max_num_reqs, -1])"
    if block_table is not None and len(np.shape(block_table)) == 1:
        dims += hint
    full = BlockTable(
        block_table=_table(block_table, who, "block_table", 2, dims, rows), block_size=bsz, null_block=null_block
    )
    table: Any = full
    if swa_block_table is not None:
        swa = BlockTable(
            block_table=_table(swa_block_table, who, "swa_block_table", 2, "[num_rows, max_blocks]", rows),
            block_size=bsz,
            null_block=null_block,
        )
        table = GroupSlotTables(full=full, swa=swa)
    n = _num_reqs(num_reqs, rows, who)
    _check_block_table_values(
        who,
        _host(query_start_loc, "query_start_loc"),
        _host(seq_lens, "seq_lens"),
        _host(block_table, "block_table"),
        _host(swa_block_table, "swa_block_table"),
        t,
        _host_num_reqs(num_reqs, rows),
        bsz,
        null_block,
    )
    sm = None if slot_mapping is None else _ints(slot_mapping, who, "slot_mapping", t, "[num_tokens]")
    ex = _expected_inputs(expected_inputs, who, t)
    pool, valid = _expected_tokens(expected_tokens, expected_tokens_valid_lens, None, who, rows)
    if pool is not None and int(pool.tokens.shape[0]) < rows:
        raise ValueError(
            f"kv-canary: {who}: expected_tokens must have at least {rows} rows [num_rows, max_model_len], got "
            f"{_describe(pool.tokens)}"
        )

    rpi, prefix, extend = _block_table_rows(qsl, seq, n)
    loc = _vllm_out_cache_loc(qsl, prefix, rpi, n, sm, full, num_tokens=t)
    return CanaryBatch.prechecked(
        req_pool_indices=rpi,
        prefix_lens=prefix,
        extend_seq_lens=extend,
        input_ids=ids,
        positions=pos,
        out_cache_loc=loc,
        req_to_token=table,
        expected_inputs=ex,
        req_to_verify_expected_tokens=pool,
        req_to_verify_expected_tokens_valid_lens=valid,
    )


@jax.jit
def _kv_lens(prefix: jax.Array, extend: jax.Array) -> jax.Array:
    return pairs.pack(pairs.add(pairs.unpack(prefix), pairs.unpack(extend)))


def sweep_plan_after_step(
    batch: CanaryBatch,
    *,
    verify_capacity: int,
    swa_window_size: int = 0,
    full_to_swa_index_mapping: Any = None,
) -> VerifyPlan:
    """A sweep VerifyPlan over every KV token the batch's requests hold after the step.

    For each live row ``r`` (``req_pool_indices[r] != 0``), positions ``[ws, prefix_lens[r] +
    extend_seq_lens[r])`` read through the batch's own slot table (dense, block table or ragged), prev = the
    real predecessor; exactly :func:`canary_jax.runtime.sweep.build_sweep_plan_from_requests` with ``seq_lens =
    prefix + extend``, for any batch convention. Run it with :func:`~canary_jax.runtime.step.canary_sweep`
    after the step's TAIL. Jit-able; overflow sets ``enable = 0``.

    Args:
      batch: a CanaryBatch (from SGLang fields or the adapters here).
      verify_capacity: C (static).
      swa_window_size, full_to_swa_index_mapping: as for :func:`~canary_jax.plan_builder.build_plans` (the
        window of an SWA group; the LUT is not applied to a GroupSlotTables' ``swa`` table).

    Returns:
      The VerifyPlan.

    Raises:
      TypeError: ``batch`` not a CanaryBatch; ValueError / TypeError from ``build_plans``.
    """
    if not isinstance(batch, CanaryBatch):
        raise TypeError(f"kv-canary: sweep_plan_after_step: batch must be a CanaryBatch, got {type(batch).__name__}")
    bs = batch.batch_size
    vp, _ = build_plans(
        req_pool_indices=batch.req_pool_indices,
        prefix_lens=_kv_lens(jnp.asarray(batch.prefix_lens), jnp.asarray(batch.extend_seq_lens)),
        extend_seq_lens=np.zeros((bs,), np.int32),
        req_to_token=batch.req_to_token,
        verify_capacity=verify_capacity,
        write_req_capacity=max(1, bs),
        swa_window_size=swa_window_size,
        full_to_swa_index_mapping=full_to_swa_index_mapping,
    )
    return vp


@jax.jit
def _update_lut(lut: jax.Array, full: jax.Array, swa: jax.Array) -> jax.Array:
    n, t = lut.shape[0], full.shape[0]
    if n == 0 or t == 0:
        return lut
    idx, ok = pairs.index(pairs.unpack(full), n)
    order = jnp.arange(t, dtype=jnp.int32)
    target = jnp.where(ok, idx, n)  # n: dropped
    winner = jnp.full((n,), -1, jnp.int32).at[target].max(order, mode="drop")
    win = ok & (winner[jnp.where(ok, idx, 0)] == order)
    return lut.at[jnp.where(win, idx, n)].set(swa, mode="drop")


def update_swa_lut(lut: Any, full_slots: Any, swa_slots: Any) -> jax.Array:
    """``lut[full_slots[t]] = swa_slots[t]`` for this step's tokens: the full-to-SWA LUT an SWA canary group
    applies to ``out_cache_loc`` when it writes, kept current from two per-token slot mappings (vLLM's hybrid
    KV cache gives one ``slot_mapping`` per KV-cache group).

    With :func:`from_block_tables` ``swa_block_table=...`` the SWA group's *plans* read the SWA block table
    directly, so the LUT only has to be right for the tokens written this step: ``O(T)`` per step, no eviction
    bookkeeping. Store the result in the SWA group (``swa_index_lut``) before the step's HEAD. Jit-able.

    Args:
      lut: int64-valued ``[full_pool_size + 1]`` (any lossless int form; ``uint32[L, 2]`` pairs returned).
      full_slots: int64-valued ``[T]`` full-pool slots (entries outside ``[0, L)``, e.g. -1 padding, are
        skipped).
      swa_slots: int64-valued ``[T]`` SWA-pool slots of the same tokens.

    Returns:
      ``uint32[L, 2]``: the updated LUT. A full slot named twice takes the later token's SWA slot.

    Raises:
      ValueError / TypeError: wrong ranks, lengths or dtypes (naming the argument).
    """
    who = "update_swa_lut"
    table = ints.as_int64_pairs(lut, name=f"{who}: lut", shape=(None,))
    full = _ints(full_slots, who, "full_slots", None, "[num_tokens]")
    swa = _ints(swa_slots, who, "swa_slots", int(full.shape[0]), "[num_tokens]")
    return _update_lut(jnp.asarray(table), full, swa)


def _unchecked(cls, **fields):
    """A registered table from fields already converted and checked here (no second conversion)."""
    obj = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(obj, name, value)
    return obj
