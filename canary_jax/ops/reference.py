"""Pure-jnp references of the verify and write kernels: the byte-level contract every backend matches.

They follow SGLang's torch references (``verify_ref.py``: ``launch_canary_verify_kernel_torch_reference``,
``write_ref.py``: ``launch_canary_write_kernel_torch_reference``) and SPEC sections 5 and 6, but are
functional (state in, new state out), jit-able with fixed capacities, free of host syncs and of Python loops
over entries, and identical with ``jax_enable_x64`` off and on (64-bit values are uint32 pairs).

Decisions where SGLang is undefined or backends disagree (SPEC 13; tests pin each):

* Out-of-range indices never touch memory outside a buffer. A verify slot or prev slot outside
  ``[0, num_slots)`` (other than the skip value 0 and the anchor value < 0 for prev) reads as an all-zero
  record (and an out-of-range verify slot's expected real-KV fingerprint is 0, whatever the sources hold),
  so the entry normally fails and the row names the bad slot. A write entry whose slot is negative
  or ``>= num_slots`` is skipped (no store, no count, no chain advance), like SGLang's ``< 0`` rule. A seed
  slot ``>= num_slots`` reads as an all-zero record. Real-KV bytes outside a source read as zeros.
* Write seeds are read from the canary as it was before the launch (SPEC 6.3 and the CUDA kernel); the torch
  reference would see a seed slot written earlier in the same launch, a racy case on CUDA.
* Two write entries of one launch storing the same slot: the later entry (request-major order) wins, as in
  the torch reference; CUDA leaves it to a race.
* Write offsets must be non-decreasing over the live requests (the plan builders guarantee it); offsets
  are clamped into ``[0, num_tokens]``.

Cost model (the reference is the path CPUs and TPUs run):

* verify follows the live entries, not the capacity ``C`` (SGLang sizes ``C`` at 3x the pool). One
  ``lax.switch`` branch per prefix size of :func:`prefix_buckets` (``0``, then 64, 256, 1024, ... below ``C``,
  then ``C``), chosen on device from ``min(num_valid, C)`` (0 when ``enable == 0``): the branch for ``n``
  loads, hashes and appends entries ``[0, n)`` only, so ``L`` live entries cost at most
  ``max(64, 4 L)`` entries of work, and a disabled or empty launch reads nothing. Rows, their order, the
  write index and the counters are those of the whole-capacity computation (dead entries never record).
  The price is compile time and code size: about ``log4(C / 64) + 2`` branch bodies (on a CPU about 0.5-0.8 s
  of compile each, and XLA:CPU keeps every compiled body's memory mappings). Capacities up to 64 compile one
  body, as before.
* write follows the launch's token arrays (``T`` = ``input_ids`` length, which the runtime pads to a bucket
  of the live batch) and the serial chain runs ``max`` live request length steps of ``Cw`` lanes each. It is
  not bucketed: its arrays are the batch itself, not a pool-sized capacity.
* Real-KV work is ``effective_read_bytes`` per processed entry and source (16 under PARTIAL, ``read_bytes``
  under ALL); no pass reads a whole source or the whole canary buffer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from canary_jax.contract import constants, hashing, layout, pairs, sources
from canary_jax.planning.plans import VerifyOrWriteContext, VerifyPlan, WritePlan

MIN_PREFIX_BUCKET = 64  # smallest non-empty prefix a verify branch processes (see the module docstring)
PREFIX_BUCKET_GROWTH = 4  # ratio of consecutive prefix sizes: bounds the branches (compile) to about log4(C / 64) + 2


def load_records(canary_buf: jax.Array, slot: jax.Array, ok: jax.Array) -> jax.Array:
    """Fields 0..3 of ``slot`` as ``uint32[..., 4, 2]``; zeros where ``~ok``.

    Gathers the 32 record bytes of each slot from the ``uint8[N, S]`` buffer and bitcasts only those, so the
    cost follows the number of slots read, not the pool size.
    """
    rec = canary_buf[slot, : constants.CANARY_SLOT_BYTES]  # uint8[..., 32]
    rec = jax.lax.bitcast_convert_type(rec.reshape(slot.shape + (2 * constants.CANARY_FIELDS_PER_SLOT, 4)), jnp.uint32)
    rec = jnp.where(ok[..., None], rec, jnp.uint32(0))
    return rec.reshape(slot.shape + (constants.CANARY_FIELDS_PER_SLOT, 2))


def store_records(canary_buf: jax.Array, slot: jax.Array, store: jax.Array, fields: jax.Array) -> jax.Array:
    """Writes ``fields`` (``uint32[T, 8]``: the four int64 fields as pairs) into the first 32 bytes of
    ``slot`` where ``store``; other bytes and slots are untouched (a scatter of ``T`` rows)."""
    n_slots = canary_buf.shape[0]
    rows = jax.lax.bitcast_convert_type(fields, jnp.uint8).reshape(fields.shape[0], constants.CANARY_SLOT_BYTES)
    dest = jnp.where(store, slot, n_slots)  # n_slots is out of bounds -> dropped
    return canary_buf.at[dest, : constants.CANARY_SLOT_BYTES].set(rows, mode="drop")


def chain_hash_of(records: jax.Array) -> pairs.U64:
    """``mix3(prev_hash, token, position)`` of records ``uint32[..., 4, 2]`` (SPEC 2.3)."""
    return hashing.splitmix64_mix3(
        pairs.unpack(records[..., constants.CANARY_FIELD_PREV_HASH, :]),
        pairs.unpack(records[..., constants.CANARY_FIELD_TOKEN, :]),
        pairs.unpack(records[..., constants.CANARY_FIELD_POSITION, :]),
    )


def _rows(tag: int, cols: list[jax.Array]) -> jax.Array:
    """Assembles ``uint32[K, 8, 2]`` violation rows from 7 pair columns after the tag."""
    k = cols[0].shape[0]
    tag_col = pairs.pack(pairs.const(int(tag), (k,)))
    return jnp.stack([tag_col] + cols, axis=1)


# --- verify ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("check_verify_expected_token",))
def verify_reference(
    context: VerifyOrWriteContext, plan: VerifyPlan, *, check_verify_expected_token: bool = False
) -> VerifyOrWriteContext:
    """Verifies ``plan``'s entries against ``context.canary_buf`` and returns the context with its new log.

    For each live entry ``i < min(num_valid, C)`` with ``slot = slot_indices[i] != 0``: load the slot's
    ``(tok, pos, prev, rkv)``; ``exp_chain = mix3(fields of prev_slot)`` (anchor hash if prev_slot < 0,
    stored ``prev`` if prev_slot == 0); ``exp_rkv`` = real-KV fingerprint of ``slot``; fail bits
    chain(1) | position(2) | real_kv(4) | token(32, only with the check flag and expected != -1).

    Calling contract (SGLang ``launch_canary_verify_kernel``; reference ``verify_ref.py``):
      * ``kernel_run_counters[tag] += 1`` always; if ``enable[0] == 0`` nothing else changes.
      * ``slot_run_counters[tag] += min(num_valid, C)``: counted before the slot-0 skip.
      * Each failing entry appends ``[tag, slot, stored pos, stored tok, exp tok | -1, stored prev,
        exp_chain, bits]`` in ascending entry order to the fill-once ring; ``write_index`` grows by the
        number of failures even past the ring's capacity.
      * The canary buffer and the real-KV sources are read-only.

    Args:
      context: see :class:`~canary_jax.planning.plans.VerifyOrWriteContext`.
      plan: see :class:`~canary_jax.planning.plans.VerifyPlan`.
      check_verify_expected_token: static; when False the expected-token array is not consulted and
        column 4 holds -1.

    Returns:
      ``context`` with a new ``log`` (the canary buffer is unchanged).
    """
    cap = plan.verify_slot_indices.shape[0]
    enabled = plan.enable[0] != 0
    active = jnp.where(enabled, jnp.clip(plan.verify_num_valid[0], 0, cap), 0)
    sizes = prefix_buckets(cap)
    branches = [
        functools.partial(_verify_prefix, n=n, check_verify_expected_token=check_verify_expected_token) for n in sizes
    ]
    log = jax.lax.switch(bucket_index(active, sizes), branches, context, plan, active)
    log = layout.bump_counters(log, int(context.kernel_kind), active.astype(jnp.uint32))
    return context.replace(log=log)


def prefix_buckets(capacity: int) -> tuple[int, ...]:
    """The static prefix sizes a capacity-``capacity`` verify can process, one ``lax.switch`` branch each.

    ``0`` (nothing live: disabled, or ``num_valid <= 0``), then :data:`MIN_PREFIX_BUCKET` times powers of
    :data:`PREFIX_BUCKET_GROWTH` below ``capacity``, then ``capacity`` itself; ascending and distinct. E.g.
    ``prefix_buckets(8) == (0, 8)``, ``prefix_buckets(8192) == (0, 64, 256, 1024, 4096, 8192)``.
    """
    sizes = [0]
    size = MIN_PREFIX_BUCKET
    while size < capacity:
        sizes.append(size)
        size *= PREFIX_BUCKET_GROWTH
    if capacity > 0:
        sizes.append(capacity)
    return tuple(sizes)


def bucket_index(count: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
    """``int32`` index of the smallest ``sizes[k] >= count`` (``count``: int32 scalar in ``[0, sizes[-1]]``)."""
    return jnp.sum(jnp.asarray(sizes[:-1], jnp.int32) < count).astype(jnp.int32)


def _verify_prefix(
    context: VerifyOrWriteContext, plan: VerifyPlan, active: jax.Array, *, n: int, check_verify_expected_token: bool
) -> layout.ViolationLog:
    """One branch of :func:`verify_reference`: entries ``[0, n)`` only (``active <= n``); returns the log with
    the failing entries' rows appended (counters untouched). Shapes in here are ``n``, never the capacity."""
    if n == 0:
        return context.log
    descs = sources.source_descriptors(context.real_kv_sources, context.real_kv_hash_mode)
    tag = int(context.kernel_kind)
    buf = context.canary_buf
    n_slots = buf.shape[0]
    live = jnp.arange(n, dtype=jnp.int32) < active

    slot_p = plan.verify_slot_indices[:n]
    considered = live & ~pairs.is_zero(pairs.unpack(slot_p))
    slot, slot_ok = pairs.index(pairs.unpack(slot_p), n_slots)
    rec = load_records(buf, slot, slot_ok & considered)
    tok, pos, prev, rkv = (rec[..., f, :] for f in range(4))

    prev_p = plan.verify_prev_slot_indices[:n]
    prev_slot, prev_ok = pairs.index(pairs.unpack(prev_p), n_slots)
    prev_rec = load_records(buf, prev_slot, prev_ok & considered)
    computed = pairs.pack(chain_hash_of(prev_rec))
    anchor = pairs.pack(pairs.const(hashing.ANCHOR_HASH, (n,)))
    reachable = ~pairs.is_zero(pairs.unpack(prev_p))
    exp_chain = jnp.where(pairs.is_negative(pairs.unpack(prev_p))[..., None], anchor, computed)
    exp_chain = jnp.where(reachable[..., None], exp_chain, prev)

    if check_verify_expected_token:
        exp_tok = plan.verify_expected_tokens[:n]
        tok_fail = ~pairs.is_minus_one(pairs.unpack(exp_tok)) & pairs.ne(pairs.unpack(tok), pairs.unpack(exp_tok))
    else:
        exp_tok = pairs.pack(pairs.const(-1, (n,)))
        tok_fail = jnp.zeros((n,), bool)

    tensors = [s.tensor for s in context.real_kv_sources]
    exp_rkv = pairs.pack(sources.real_kv_hash_reference(tensors, descs, jnp.where(slot_ok, slot, -1)))

    chain_fail = reachable & pairs.ne(pairs.unpack(prev), pairs.unpack(exp_chain))
    pos_fail = pairs.ne(pairs.unpack(pos), pairs.unpack(plan.verify_expected_positions[:n]))
    rkv_fail = pairs.ne(pairs.unpack(rkv), pairs.unpack(exp_rkv))
    bits = (
        jnp.where(chain_fail, constants.FailReason.VERIFY_CHAIN_HASH_MISMATCH, 0)
        | jnp.where(pos_fail, constants.FailReason.VERIFY_POSITION_MISMATCH, 0)
        | jnp.where(rkv_fail, constants.FailReason.VERIFY_REAL_KV_HASH_MISMATCH, 0)
        | jnp.where(tok_fail, constants.FailReason.VERIFY_TOKEN_MISMATCH, 0)
    ).astype(jnp.uint32)
    record = considered & (bits != 0)
    bits_p = jnp.stack([bits, jnp.zeros_like(bits)], axis=-1)
    rows = _rows(tag, [slot_p, pos, tok, exp_tok, prev, exp_chain, bits_p])
    return layout.append_violation_rows(context.log, rows, record)


# --- write -----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("enable_write_input_assert",))
def write_reference(
    context: VerifyOrWriteContext,
    plan: WritePlan,
    input_ids: jax.Array,
    positions: jax.Array,
    out_cache_loc: jax.Array,
    *,
    enable_write_input_assert: bool = False,
    expected_input_tokens: jax.Array | None = None,
    expected_input_positions: jax.Array | None = None,
) -> VerifyOrWriteContext:
    """Stamps ``(token, position, chain prev_hash, real_kv_hash)`` into every written slot.

    One serial chain per request row ``r < min(write_num_valid_reqs, Cw)`` over entries
    ``[off[r], off[r+1])``: ``running = compute_slot_hash(seed)`` (anchor if seed < 0); for each entry with
    ``slot >= 0``: optional input-assert row (bits 8 / 16), optional chain-position row (bit 16, when
    ``seed >= 0`` and ``enable_chain_position_assert``), store ``(tok, pos, running, rkv)``, then
    ``running = mix3(running, tok, pos)`` on the actual values.

    Calling contract (SGLang ``launch_canary_write_kernel``; reference ``write_ref.py``):
      * ``kernel_run_counters[tag] += 1`` always; ``slot_run_counters[tag] += `` entries stored.
      * Rows go to the fill-once ring request-major, in entry order, an entry's input-assert row before its
        chain-position row.
      * Only the first 32 bytes of written slots change; the sources are read-only.

    Args:
      context: see :class:`~canary_jax.planning.plans.VerifyOrWriteContext`.
      plan: see :class:`~canary_jax.planning.plans.WritePlan`.
      input_ids, positions, out_cache_loc: ``uint32[T, 2]`` int64 pairs (see :mod:`canary_jax.contract.ints`);
        ``out_cache_loc`` already SWA-translated, negative = skip.
      enable_write_input_assert: static; compare against the expected tensors.
      expected_input_tokens, expected_input_positions: ``uint32[T, 2]`` pairs iff the assert is on.

    Returns:
      ``context`` with the new canary buffer and log.
    """
    descs = sources.source_descriptors(context.real_kv_sources, context.real_kv_hash_mode)
    tag = int(context.kernel_kind)
    buf = context.canary_buf
    n_slots = buf.shape[0]
    num_tokens = input_ids.shape[0]
    cw = plan.write_seed_slot_indices.shape[0]
    if num_tokens == 0:  # nothing to store or check: only the launch counter moves (as every backend)
        return context.replace(log=layout.bump_counters(context.log, tag, jnp.uint32(0)))

    active_reqs = jnp.clip(plan.write_num_valid_reqs[0], 0, cw)
    off = pairs.clamp(pairs.unpack(plan.write_offsets), num_tokens)
    start, end = off[:-1], off[1:]
    req_live = jnp.arange(cw, dtype=jnp.int32) < active_reqs
    count = jnp.where(req_live, jnp.maximum(end - start, 0), 0)

    # Seeds, read before anything is written.
    seed_p = plan.write_seed_slot_indices
    seed_neg = pairs.is_negative(pairs.unpack(seed_p))
    seed_slot, seed_ok = pairs.index(pairs.unpack(seed_p), n_slots)
    seed_rec = load_records(buf, seed_slot, seed_ok & ~seed_neg)
    anchor = pairs.pack(pairs.const(hashing.ANCHOR_HASH, (cw,)))
    running0 = jnp.where(seed_neg[..., None], anchor, pairs.pack(chain_hash_of(seed_rec)))
    gate = (~seed_neg) & (context.log.enable_chain_position_assert[0] != 0)
    run_pos0 = jnp.where(gate[..., None], seed_rec[:, constants.CANARY_FIELD_POSITION, :], jnp.uint32(0))

    # Serial chain: step j handles entry start[r] + j of every request r in parallel.
    slot_all_p = out_cache_loc
    entry_ok = (~pairs.is_negative(pairs.unpack(slot_all_p))) & pairs.in_range(pairs.unpack(slot_all_p), n_slots)
    max_count = jnp.max(count, initial=0)

    def body(state):
        j, running, run_pos, prev_at, chain_fail, chain_exp, written = state
        step_live = j < count
        i = jnp.where(step_live, start + j, 0)
        ok = step_live & entry_ok[i]
        tok = input_ids[i]
        pos = positions[i]
        want = pairs.pack(pairs.add(pairs.unpack(run_pos), 1))
        cfail = ok & gate & pairs.ne(pairs.unpack(pos), pairs.unpack(want))
        dest = jnp.where(ok, i, num_tokens)  # num_tokens is out of bounds -> dropped
        prev_at = prev_at.at[dest].set(running, mode="drop")
        chain_fail = chain_fail.at[dest].set(cfail, mode="drop")
        chain_exp = chain_exp.at[dest].set(want, mode="drop")
        written = written.at[dest].set(True, mode="drop")
        nxt = pairs.pack(hashing.splitmix64_mix3(pairs.unpack(running), pairs.unpack(tok), pairs.unpack(pos)))
        running = jnp.where(ok[..., None], nxt, running)
        run_pos = jnp.where((ok & gate)[..., None], pos, run_pos)
        return j + 1, running, run_pos, prev_at, chain_fail, chain_exp, written

    init = (
        jnp.int32(0),
        running0,
        run_pos0,
        jnp.zeros((num_tokens, 2), jnp.uint32),
        jnp.zeros((num_tokens,), bool),
        jnp.zeros((num_tokens, 2), jnp.uint32),
        jnp.zeros((num_tokens,), bool),
    )
    _, _, _, prev_at, chain_fail, chain_exp, written = jax.lax.while_loop(lambda s: s[0] < max_count, body, init)

    # Real-KV fingerprints of every written slot: parallel, off the serial path.
    slot_idx, _ = pairs.index(pairs.unpack(slot_all_p), n_slots)
    tensors = [s.tensor for s in context.real_kv_sources]
    rkv = pairs.pack(sources.real_kv_hash_reference(tensors, descs, jnp.where(written, slot_idx, -1)))

    # Violation rows: per entry [input-assert row, chain-position row].
    if enable_write_input_assert:
        tfail = pairs.ne(pairs.unpack(input_ids), pairs.unpack(expected_input_tokens))
        pfail = pairs.ne(pairs.unpack(positions), pairs.unpack(expected_input_positions))
        in_bits = (
            jnp.where(tfail, constants.FailReason.WRITE_TOKEN_MISMATCH, 0)
            | jnp.where(pfail, constants.FailReason.WRITE_POSITION_MISMATCH, 0)
        ).astype(jnp.uint32)
        in_rec = written & (in_bits != 0)
        in_rows = _rows(
            tag,
            [
                slot_all_p,
                positions,
                input_ids,
                expected_input_tokens,
                prev_at,
                expected_input_positions,
                jnp.stack([in_bits, jnp.zeros_like(in_bits)], -1),
            ],
        )
    else:
        in_rec = jnp.zeros((num_tokens,), bool)
        in_rows = jnp.zeros((num_tokens, constants.VIOLATION_FIELDS, 2), jnp.uint32)
    ch_bits = pairs.pack(pairs.const(int(constants.FailReason.WRITE_POSITION_MISMATCH), (num_tokens,)))
    ch_rows = _rows(tag, [slot_all_p, positions, input_ids, input_ids, prev_at, chain_exp, ch_bits])
    rows = jnp.stack([in_rows, ch_rows], axis=1).reshape(2 * num_tokens, constants.VIOLATION_FIELDS, 2)
    record = jnp.stack([in_rec, chain_fail & written], axis=1).reshape(2 * num_tokens)
    log = layout.append_violation_rows(context.log, rows, record)
    log = layout.bump_counters(log, tag, jnp.sum(written).astype(jnp.uint32))

    # Stores: the last entry writing a slot wins.
    winner = last_writer_mask(slot_idx, written, n_slots)
    fields = jnp.stack([input_ids, positions, prev_at, rkv], axis=1)
    fields = fields.reshape(num_tokens, 2 * constants.CANARY_FIELDS_PER_SLOT)
    return context.replace(canary_buf=store_records(buf, slot_idx, winner, fields), log=log)


def last_writer_mask(slot: jax.Array, written: jax.Array, n_slots: int) -> jax.Array:
    """``bool[T]``: entry ``i`` is written and no later written entry has the same slot."""
    t = slot.shape[0]
    if t == 0:
        return written
    key = jnp.where(written, slot, n_slots)
    idx = jnp.arange(t, dtype=jnp.int32)
    skey, sidx = jax.lax.sort((key, idx), num_keys=2)
    last = jnp.concatenate([skey[1:] != skey[:-1], jnp.ones((1,), bool)])
    win_sorted = last & (skey < n_slots)
    return jnp.zeros((t,), bool).at[sidx].set(win_sorted)
