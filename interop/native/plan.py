"""The plan launch as hand-written torch ops: SGLang's ``launch_canary_plan_kernels`` (SPEC 7) in one pass.

:func:`launch_plan` fills the torch ``VerifyPlan`` / ``WritePlan`` in place with exactly the bytes of canary-jax's
jnp builder (:func:`canary_jax.planning.plan_builder.build_plans`, run by :func:`interop.kernels.plan_body_factory`),
which is the contract here, but with native int64 torch ops: 47 torch calls per launch for a FULL group, 51 with the
SWA LUT, 53 to 59 with the expected-token pool, instead of the ~350 that replaying the builder's jaxpr costs (the
jnp code emulates int64 with uint32 word pairs). Fixed shapes and no host sync, so a torch CUDA graph captures it;
every temporary is request- or entry-sized (``req_to_token`` and the pool are read only at the planned entries).

How: per request ``r`` the entry count ``cnt = clip(P, 0, min(C + 1, W or inf))`` (0 for padding rows; clipping at
``C + 1`` keeps every sum exact and overflow-free, and ``total > C`` iff the true total is), ``incl = cumsum(cnt)``;
verify entry ``i`` finds its row with ``searchsorted(incl, i, right)`` and its position ``P - incl[r] + i``. The
slot, prev and seed reads are one ``[2C + bs]`` gather from ``req_to_token`` at ``(row, q)``: ``q = pos``,
``pos - 1`` and the seed column ``min(P, L) - 1`` (forced to -1 where the seed is -1), read as ``-1`` for ``q < 0``
and as ``TOKEN_TO_KV_SLOT_PADDING`` (0) outside the table, then through the SWA translation. Entries are written
with ``where(live, new, old)``, so whatever the builder leaves untouched keeps its bytes.
"""

from __future__ import annotations

import torch

from canary_jax.contract import ints, validation

__all__ = ["launch_plan"]

_V = "verify_plan_out."
_W = "write_plan_out."


def _translate(x: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """SWA translation ``x < 0 -> x, else lut[min(x, len(lut) - 1)]`` (the builder clamps like SGLang's kernels;
    ``len(lut) >= 1`` is the launcher's check). int32 or int64 ``x`` -> int64."""
    top = min(int(lut.shape[0]) - 1, ints.INT32_MAX)
    return torch.where(x < 0, x, lut[x.clamp(0, top)])


def launch_plan(statics: tuple, tensors: dict[str, torch.Tensor]) -> None:
    """Builds one group's VerifyPlan and WritePlan in place (SPEC 7; bytes of ``plan_builder.build_plans``).

    For request row ``r`` (``rpi = req_pool_indices[r]``, ``P = prefix_lens[r]``, ``E = extend_seq_lens[r]``,
    ``L = req_to_token.shape[1]``, ``T`` = the SWA translation, identity without a LUT)::

        verify: skip r if rpi == 0; ws = max(0, P - W) if W > 0 else 0; for p in [ws, P), request-major:
                  slot = T(rtt(rpi, p)), prev = -1 if p == 0 else T(rtt(rpi, p - 1)), position = p,
                  token = pool[rpi, p + k] if the pool is given and 0 <= p + k < valid_lens[r] (and in the pool)
                          else -1
                total = number of entries; total > C: enable = 0, num_valid = C, no entry written;
                otherwise enable = 1, num_valid = total, entries [0, total) written, the rest keep their bytes
        write:  wlen = E if rpi != 0 and E > 0 else 0; write_offsets = [0, cumsum(wlen)..., 0...] (tail zeroed)
                seed[r] = -1 if rpi == 0 or E <= 0 or P <= 0 else T(rtt(rpi, min(P, L) - 1)); seeds past bs kept
                write_num_valid_reqs = bs

    ``rtt(row, col)`` is ``req_to_token[row, col]`` (int32 sign-extended), or 0 when ``row`` or ``col`` is outside
    the table; ``T`` maps a slot ``x >= len(lut)`` to ``lut[-1]``; pool reads outside the pool give -1. These are
    the builder's decisions (``canary_jax/planning/plan_builder.py`` module docstring) where SGLang's reference raises.

    Calling contract: mutates only the ``verify_plan_out.*`` and ``write_plan_out.*`` tensors; reads the rest.
    Vectorised over fixed shapes (``bs``, C, Cw and the table shapes), no host sync, no data-dependent shapes:
    CUDA-graph capturable. Arguments are the launcher's, already validated
    (:func:`interop.sglang.launch_canary_plan_kernels`): this function checks nothing.

    Args:
      statics: ``(swa_window_size W >= 0, kv_token_id_vs_position_offset k, has_lut, has_pool)``.
      tensors: by SGLang name, all on one device, contiguous:
        ``req_pool_indices``, ``prefix_lens``, ``extend_seq_lens``: int64 ``[bs]`` (rpi 0 = padding row);
        ``req_to_token``: int32 ``[max_reqs, L]``;
        ``full_to_swa_index_mapping``: int64 ``[lut_len >= 1]`` (iff ``has_lut``; 0 = evicted);
        ``req_to_verify_expected_tokens``: int32 ``[rows, ctx]`` and
        ``req_to_verify_expected_tokens_valid_lens``: int64 ``[bs]`` (iff ``has_pool``);
        outputs ``verify_plan_out.<f>`` for ``validation.VERIFY_PLAN_FIELDS`` (four int64 ``[C]``,
        ``verify_num_valid`` and ``enable`` int32 ``[1]``) and ``write_plan_out.<f>`` for
        ``validation.WRITE_PLAN_FIELDS`` (``write_offsets`` int64 ``[Cw + 1]``, ``write_seed_slot_indices``
        int64 ``[Cw]``, ``write_num_valid_reqs`` int32 ``[1]``), with ``bs <= Cw``.
    """
    w, k, has_lut, has_pool = statics
    w, k = int(w), int(k)
    rpi, plen, elen = tensors["req_pool_indices"], tensors["prefix_lens"], tensors["extend_seq_lens"]
    rtt = tensors["req_to_token"]
    v_slot, v_tok, v_pos, v_prev = (tensors[_V + f] for f in validation.VERIFY_PLAN_FIELDS[:4])
    num_valid_out, enable_out = tensors[_V + "verify_num_valid"], tensors[_V + "enable"]
    offsets, seeds_out, num_reqs_out = (tensors[_W + f] for f in validation.WRITE_PLAN_FIELDS)
    lut = tensors["full_to_swa_index_mapping"] if has_lut else None
    bs, cap = int(rpi.shape[0]), int(v_slot.shape[0])
    n_rows, seq = (int(d) for d in rtt.shape)

    if bs == 0:  # no entries: enable 1, num_valid 0; entries and seeds keep their bytes
        num_valid_out.zero_()
        enable_out.fill_(1)
        offsets.zero_()
        num_reqs_out.fill_(0)
        return

    # --- per request ---------------------------------------------------------------------------------------
    pad = rpi == 0  # REQ_POOL_IDX_PADDING
    bound = cap + 1 if w <= 0 else min(cap + 1, w)  # P - ws = min(P, W); C + 1 keeps the sums exact
    cnt = plen.clamp(0, bound).masked_fill_(pad, 0)
    incl = cnt.cumsum(0)
    row = rpi.clamp(0, max(n_rows - 1, 0))
    row_ok = row == rpi
    lim = row_ok * seq  # positions [0, lim) of the row can be read; none for a row outside the table
    wlen = elen.clamp(min=0).masked_fill_(pad, 0)
    # The seed is the slot of column min(P, L) - 1 (column 0 of an empty table); q = -1 (read as -1) where the seed
    # is -1 (rpi 0, E <= 0 or P <= 0).
    q_seed = torch.where(wlen > 0, plen.clamp(0, max(seq, 1)), 0) - 1
    fields = [plen - incl, row, lim]  # per-request values every entry of the row needs

    pool = pool_rows = None
    if has_pool:
        pool = tensors["req_to_verify_expected_tokens"]
        p_rows, p_cols = (int(d) for d in pool.shape)
        if p_rows == 0 or p_cols == 0:
            pool = None  # every read is outside the pool: all tokens -1
        else:
            pool_row, pool_ok = row, row_ok
            if p_rows != n_rows:
                pool_row = rpi.clamp(0, p_rows - 1)
                pool_ok = pool_row == rpi
                pool_rows = len(fields)
                fields.append(pool_row)
            valid = tensors["req_to_verify_expected_tokens_valid_lens"]
            # entry p has a token iff 0 <= p + k < tok_lim (the valid length, cut to the pool); as p < tok_lim - k
            tok_lim = torch.where(pool_ok, valid.clamp(0, p_cols), 0)
            fields.append(tok_lim - k if k else tok_lim)

    # --- per verify entry ----------------------------------------------------------------------------------
    i = torch.arange(cap, device=rpi.device)
    r = torch.searchsorted(incl, i, right=True).clamp_(max=bs - 1)  # dead entries (i >= total) take the last row
    at_r = torch.stack(fields)[:, r].unbind(0)
    pos = at_r[0] + i
    q = torch.cat([pos, pos - 1, q_seed])  # slot, prev and seed columns
    if n_rows == 0 or seq == 0:
        x = q.clamp(-1, 0)  # every read is outside the table
    else:
        rows = torch.cat([at_r[1], at_r[1], row])
        v = rtt[rows, q.clamp(0, seq - 1)]
        x = torch.where(q < torch.cat([at_r[2], at_r[2], lim]), torch.where(q < 0, -1, v), 0)
    if lut is not None:
        x = _translate(x, lut)
    slot, prev, seed = x.split([cap, cap, bs])

    tok = None
    if pool is not None:
        col = (pos + k if k else pos).clamp(0, p_cols - 1)
        tok_ok = pos < at_r[-1]
        if k < 0:
            tok_ok = tok_ok & (pos >= -k)
        tok = torch.where(tok_ok, pool[at_r[1 if pool_rows is None else pool_rows], col], -1)

    # --- outputs (every input has been read) -----------------------------------------------------------------
    total = incl[-1:]
    torch.le(total, cap, out=enable_out)
    num_valid_out.copy_(total.clamp(max=cap))
    live = i < total * enable_out  # nothing is live on overflow
    torch.where(live, slot, v_slot, out=v_slot)
    torch.where(live, pos, v_pos, out=v_pos)
    torch.where(live, prev, v_prev, out=v_prev)
    if tok is None:
        v_tok.masked_fill_(live, -1)
    else:
        torch.where(live, tok, v_tok, out=v_tok)
    seeds_out[:bs] = seed
    offsets.zero_()
    torch.cumsum(wlen, 0, out=offsets[1 : bs + 1])
    num_reqs_out.fill_(bs)
