"""An independent re-implementation of SGLang's torch references, for the interop parity tests.

``ref_verify`` / ``ref_write`` / ``ref_plan`` take SGLang-shaped torch objects (anything with SGLang's
attribute names) and mutate their tensors in place exactly as SGLang's ``launch_canary_*_torch_reference``
functions do (SPEC sections 5, 6, 7), written from the SPEC with Python ints; it never imports canary_jax or
interop. Where SGLang's torch reference is racy or undefined it follows canary-jax's documented decisions:
write seeds (and the chain-position seed position) are read from the canary as it was before the launch;
two entries storing one slot: the later one wins. Tensors may live on any device (work happens on CPU copies
that are copied back).

``tests/test_torch_reference.py`` pins the re-implementation itself to SPEC 2.6's worked numbers.
"""

from __future__ import annotations

import torch

MASK = (1 << 64) - 1
ANCHOR = 0xC0FFEE1234567890
CHAIN, POSITION, REAL_KV, WRITE_TOKEN, WRITE_POSITION, TOKEN = 1, 2, 4, 8, 16, 32


def splitmix64(x: int) -> int:
    x &= MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def mix3(a: int, b: int, c: int) -> int:
    h = splitmix64(a)
    h = splitmix64(h ^ (b & MASK))
    return splitmix64(h ^ (c & MASK))


def s64(v: int) -> int:
    v &= MASK
    return v - (1 << 64) if v >> 63 else v


ANCHOR_HASH = splitmix64(ANCHOR)


def _fields(buf_rows: list[list[int]], slot: int) -> tuple[int, int, int, int]:
    r = buf_rows[slot]
    return r[0], r[1], r[2], r[3]


def _slot_hash(buf_rows, slot: int) -> int:
    if slot < 0:
        return ANCHOR_HASH
    tok, pos, prev, _ = _fields(buf_rows, slot)
    return mix3(prev, tok, pos)


def _host_sources(sources, mode: int):
    if mode == 0 or not sources:
        return []
    out = []
    for s in sources:
        u8 = s.tensor.detach().cpu().contiguous().view(torch.uint8)
        eff = 16 if mode == 1 else int(s.read_bytes)
        out.append((u8, int(s.page_size), int(s.num_bytes_per_token), eff))
    return out


def real_kv_hash(host_sources, slot: int) -> int:
    if not host_sources:
        return 0
    acc = 0
    for u8, page, nbpt, eff in host_sources:
        row, col = slot // page, (slot % page) * nbpt
        raw = bytes(u8[row, col : col + eff].tolist())
        h = 0
        for w in range(0, len(raw), 8):
            h = splitmix64(h ^ int.from_bytes(raw[w : w + 8], "little"))
        acc = splitmix64(acc ^ h)
    return acc


def _rows_of(buf: torch.Tensor) -> list[list[int]]:
    return buf.detach().cpu().contiguous().view(torch.int64)[:, :4].tolist()


def _store_rows(buf: torch.Tensor, rows: list[list[int]]) -> None:
    host = buf.detach().cpu().clone()
    host.view(torch.int64)[:, :4] = torch.tensor(rows, dtype=torch.int64)
    buf.copy_(host.to(buf.device))


def _append(context, rows: list[list[int]]) -> None:
    if not rows:
        return
    ring = context.violation_ring
    wi = int(context.violation_write_index.item())
    cap = int(ring.shape[0])
    host = ring.detach().cpu().clone()
    for j, row in enumerate(rows):
        if wi + j < cap:
            host[wi + j] = torch.tensor([s64(v) for v in row], dtype=torch.int64)
    ring.copy_(host.to(ring.device))
    context.violation_write_index.add_(len(rows))


def ref_verify(*, context, plan, check_verify_expected_token: bool) -> None:
    """SGLang ``launch_canary_verify_kernel_torch_reference`` semantics (SPEC 5)."""
    context.kernel_run_counter.add_(1)
    if int(plan.enable.item()) == 0:
        return
    cap = int(plan.verify_slot_indices.shape[0])
    active = max(0, min(int(plan.verify_num_valid.item()), cap))
    context.slot_run_counter.add_(active)
    if active == 0:
        return
    slots = plan.verify_slot_indices[:active].tolist()
    exp_tok = plan.verify_expected_tokens[:active].tolist() if check_verify_expected_token else [-1] * active
    exp_pos = plan.verify_expected_positions[:active].tolist()
    prevs = plan.verify_prev_slot_indices[:active].tolist()
    buf = _rows_of(context.canary_buf)
    srcs = _host_sources(context.real_kv_sources, int(context.real_kv_hash_mode))
    tag = int(context.kernel_kind)
    rows = []
    for i in range(active):
        slot = slots[i]
        if slot == 0:
            continue
        tok, pos, prev, rkv = _fields(buf, slot)
        reachable = prevs[i] != 0
        exp_chain = s64(_slot_hash(buf, prevs[i])) if reachable else prev
        exp_rkv = s64(real_kv_hash(srcs, slot))
        bits = 0
        if reachable and prev != exp_chain:
            bits |= CHAIN
        if check_verify_expected_token and exp_tok[i] != -1 and tok != exp_tok[i]:
            bits |= TOKEN
        if pos != exp_pos[i]:
            bits |= POSITION
        if rkv != exp_rkv:
            bits |= REAL_KV
        if bits:
            rows.append([tag, slot, pos, tok, exp_tok[i], prev, exp_chain, bits])
    _append(context, rows)


def ref_write(
    *,
    context,
    plan,
    input_ids,
    positions,
    out_cache_loc,
    enable_write_input_assert: bool,
    expected_input_tokens,
    expected_input_positions,
) -> None:
    """SGLang ``launch_canary_write_kernel_torch_reference`` semantics (SPEC 6), seeds read before the launch."""
    context.kernel_run_counter.add_(1)
    cw = int(plan.write_seed_slot_indices.shape[0])
    active = max(0, min(int(plan.write_num_valid_reqs.item()), cw))
    if active == 0:
        return
    off = plan.write_offsets.tolist()
    seeds = plan.write_seed_slot_indices[:active].tolist()
    ids, pos_l, loc = input_ids.tolist(), positions.tolist(), out_cache_loc.tolist()
    if enable_write_input_assert:
        et, ep = expected_input_tokens.tolist(), expected_input_positions.tolist()
    flag = int(context.enable_chain_position_assert.item())
    before = _rows_of(context.canary_buf)
    buf = [list(r) for r in before]
    srcs = _host_sources(context.real_kv_sources, int(context.real_kv_hash_mode))
    tag = int(context.kernel_kind)
    rows, written = [], 0
    for r in range(active):
        start, end = off[r], off[r + 1]
        if end - start <= 0:
            continue
        seed = seeds[r]
        running = _slot_hash(before, seed)
        gate = seed >= 0 and flag != 0
        run_pos = before[seed][1] if gate else 0
        for i in range(start, end):
            slot = loc[i]
            if slot < 0:
                continue
            tok, pos = ids[i], pos_l[i]
            rkv = real_kv_hash(srcs, slot)
            if enable_write_input_assert:
                bits = (WRITE_TOKEN if tok != et[i] else 0) | (WRITE_POSITION if pos != ep[i] else 0)
                if bits:
                    rows.append([tag, slot, pos, tok, et[i], s64(running), ep[i], bits])
            if gate:
                if pos != run_pos + 1:
                    rows.append([tag, slot, pos, tok, tok, s64(running), run_pos + 1, WRITE_POSITION])
                run_pos = pos
            buf[slot] = [tok, pos, s64(running), s64(rkv)]
            running = mix3(running, tok, pos)
            written += 1
    _store_rows(context.canary_buf, buf)
    context.slot_run_counter.add_(written)
    _append(context, rows)


def ref_plan(
    *,
    verify_plan_out,
    write_plan_out,
    req_pool_indices,
    prefix_lens,
    extend_seq_lens,
    req_to_token,
    swa_window_size,
    full_to_swa_index_mapping,
    verify_capacity,
    req_to_verify_expected_tokens,
    req_to_verify_expected_tokens_valid_lens,
    kv_token_id_vs_position_offset,
) -> None:
    """SGLang ``launch_canary_plan_kernels_torch_reference`` semantics (SPEC 7; in-range inputs)."""
    rpi_l, p_l, e_l = req_pool_indices.tolist(), prefix_lens.tolist(), extend_seq_lens.tolist()
    r2t = req_to_token.tolist()
    lut = full_to_swa_index_mapping.tolist() if full_to_swa_index_mapping is not None else None
    pool = req_to_verify_expected_tokens.tolist() if req_to_verify_expected_tokens is not None else None
    vl = req_to_verify_expected_tokens_valid_lens.tolist() if pool is not None else None
    k = int(kv_token_id_vs_position_offset)
    w = int(swa_window_size)
    tr = (lambda x: x if x < 0 else lut[x]) if lut is not None else (lambda x: x)
    bs = len(rpi_l)
    slots, poss, toks, prevs = [], [], [], []
    for r in range(bs):
        rpi, p = rpi_l[r], p_l[r]
        if rpi == 0:
            continue
        ws = max(0, p - w) if w > 0 else 0
        for q in range(ws, p):
            slots.append(tr(r2t[rpi][q]))
            prevs.append(-1 if q == 0 else tr(r2t[rpi][q - 1]))
            poss.append(q)
            t = -1
            if pool is not None and 0 <= q + k < vl[r]:
                t = pool[rpi][q + k]
            toks.append(t)
    total = len(slots)
    vp = verify_plan_out
    if total > verify_capacity:
        vp.verify_num_valid.fill_(verify_capacity)
        vp.enable.fill_(0)
    else:
        if total:
            dev = vp.verify_slot_indices.device
            vp.verify_slot_indices[:total] = torch.tensor(slots, dtype=torch.int64, device=dev)
            vp.verify_expected_tokens[:total] = torch.tensor(toks, dtype=torch.int64, device=dev)
            vp.verify_expected_positions[:total] = torch.tensor(poss, dtype=torch.int64, device=dev)
            vp.verify_prev_slot_indices[:total] = torch.tensor(prevs, dtype=torch.int64, device=dev)
        vp.verify_num_valid.fill_(total)
        vp.enable.fill_(1)
    wp = write_plan_out
    max_seq_len = len(r2t[0]) if r2t else 0
    offs, run = [], 0
    for r in range(bs):
        offs.append(run)
        if rpi_l[r] != 0 and e_l[r] > 0:
            run += e_l[r]
    offs.append(run)
    n = int(wp.write_offsets.shape[0])
    full = (offs + [0] * n)[:n]
    wp.write_offsets.copy_(torch.tensor(full, dtype=torch.int64))
    cw = int(wp.write_seed_slot_indices.shape[0])
    for r in range(min(bs, cw)):
        if rpi_l[r] == 0 or e_l[r] <= 0 or p_l[r] <= 0:
            seed = -1
        else:
            seed = tr(r2t[rpi_l[r]][min(p_l[r] - 1, max(max_seq_len - 1, 0))])
        wp.write_seed_slot_indices[r] = seed
    wp.write_num_valid_reqs.fill_(bs)


# --- self-tests against SPEC 2.6 --------------------------------------------------------------------------
