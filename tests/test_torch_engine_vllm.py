"""A small plain-torch vLLM-style engine calling the SGLang drop-in launchers through :mod:`interop.vllm`.

The engine keeps vLLM's structures in torch: a block allocator (block 0 is the null block), per-request block
lists shared whole between requests with a common prefix (a prefix-cache hit), a persistent batch block table
``int32[bs_cap, max_blocks]`` whose rows move between steps, chunked prefill and decode under a token budget,
``slot_mapping`` per token, and one KV cache per layer in vLLM's FlashInfer layout ``[num_blocks, 2, block_size,
heads, head_dim]`` (or FlashAttention's ``[2, num_blocks, ...]``), bf16. Each step is SGLang's sequence::

    plan_inputs + launch_canary_plan_kernels -> HEAD verify -> HEAD write -> forward (random K/V into the
    slot_mapping slots, every layer) -> TAIL verify (layer-0 K, ALL) -> TAIL write

through the launchers (Pallas kernels, native torch path) and, on a cloned canary state, through the independent
re-implementation of SGLang's torch references; every canary tensor must match byte for byte. The torch adapter's
plans are also compared with the JAX adapter's (``from_block_tables`` + ``build_plans``) on the same batch.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from canary_jax.adapters.batches import from_block_tables
from canary_jax.contract import ints
from canary_jax.planning.plan_builder import build_plans
from helpers.engine_worlds import assert_parity, make_worlds, run_phase
from helpers.torch_reference import ref_plan
from interop import sglang, vllm

TAG = sglang.CanaryLaunchTag
HEAD, TAIL = int(TAG.HEAD_K_FULL), int(TAG.TAIL_K_FULL)
CHAIN, POSITION, REAL_KV, TOKEN = 1, 2, 4, 32
I64 = ints.pairs_to_int64_np


@dataclasses.dataclass(eq=False)
class Req:
    tokens: list[int]
    written: int  # tokens whose KV and canary records exist (vLLM's num_computed_tokens)
    blocks: list[int]
    target: int  # finishes once this many tokens are written


class VllmEngine:
    def __init__(
        self,
        seed,
        *,
        layout="block_first",
        device="cpu",
        path="native",
        num_blocks=64,
        block_size=4,
        max_blocks=8,
        layers=2,
        heads=2,
        head_dim=16,
        bs_cap=4,
        t_cap=24,
        chunk=8,
        max_live=6,
        verify_cap=160,
        ring=64,
    ):
        self.rng = random.Random(seed)
        self.layout, self.dev, self.path = layout, device, path
        self.B, self.max_blocks, self.max_len = block_size, max_blocks, max_blocks * block_size
        self.bs_cap, self.t_cap, self.chunk, self.max_live, self.verify_cap = bs_cap, t_cap, chunk, max_live, verify_cap
        g = torch.Generator().manual_seed(seed)
        shape = (num_blocks, 2) if layout == "block_first" else (2, num_blocks)
        shape += (block_size, heads, head_dim)
        self.kv = [torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for _ in range(layers)]
        self.free = list(range(1, num_blocks))  # block 0: vLLM's null block
        self.refs = [0] * num_blocks
        self.reqs: list[Req] = []
        self.block_table = torch.zeros(bs_cap, max_blocks, dtype=torch.int32, device=device)  # stale rows stay
        self.r2t = torch.zeros(bs_cap + 1, self.max_len, dtype=torch.int32, device=device)  # plan_inputs fills
        self.pool = torch.zeros(bs_cap + 1, self.max_len, dtype=torch.int32, device=device)
        self.stats = dict(shared=0, reused=0, chunked=0, moved=0)
        self.freed_once: set[int] = set()
        self.last_rows: dict[int, int] = {}
        num_slots = num_blocks * block_size
        self.k0 = vllm.k_source(self.kv[0], layout=layout, block_size=block_size)
        self.worlds, self.contexts = make_worlds(
            num_slots=num_slots, ring=ring, verify_cap=verify_cap, bs_cap=bs_cap, k0_source=self.k0, device=device
        )
        self.steps = 0

    # --- KV cache -----------------------------------------------------------------------------------------
    def half(self, layer, which):
        """K (0) or V (1) of a layer as ``[num_blocks, block_size, heads, head_dim]`` (a view)."""
        kv = self.kv[layer]
        return kv[:, which] if self.layout == "block_first" else kv[which]

    def flip(self, which, slot, byte=3):
        """Flips one byte of layer 0's K (0) or V (1) of ``slot``; calling it again undoes it."""
        self.half(0, which)[slot // self.B, slot % self.B].view(torch.uint8).view(-1)[byte] ^= 0x40

    # --- scheduling -------------------------------------------------------------------------------------------
    def new_request(self, tokens=None, share=True):
        donors = [r for r in self.reqs if r.written >= self.B]
        shared, blocks = [], []
        if tokens is None and share and donors and self.rng.random() < 0.7:
            d = self.rng.choice(donors)
            k = self.rng.randint(1, d.written // self.B)  # whole, full blocks of the donor's prefix
            shared, blocks = d.tokens[: k * self.B], d.blocks[:k]
            for b in blocks:
                self.refs[b] += 1
            self.stats["shared"] += 1
        if tokens is None:
            prompt = self.rng.randint(len(shared) + 1, min(len(shared) + 18, self.max_len - 2))
            tokens = shared + [self.rng.randrange(50000) for _ in range(prompt - len(shared))]
        target = self.rng.randint(len(tokens) + 2, min(len(tokens) + 10, self.max_len))
        req = Req(tokens=list(tokens), written=len(shared), blocks=list(blocks), target=target)
        self.reqs.append(req)
        return req

    def _take(self, req, budget):
        if req.written == len(req.tokens):
            req.tokens.append(self.rng.randrange(50000))  # decode: one new token
        return min(len(req.tokens) - req.written, budget, self.chunk)

    def _schedule(self):
        for _ in range(2):  # up to two arrivals per step
            if len(self.reqs) < self.max_live and (not self.reqs or self.rng.random() < 0.6):
                self.new_request()
        batch, budget = [], self.t_cap
        for req in self.reqs:
            if len(batch) == self.bs_cap or budget == 0:
                break
            n = self._take(req, budget)
            batch.append((req, n))
            budget -= n
        self.rng.shuffle(batch)  # vLLM reorders its persistent batch: rows move between steps
        return batch

    def _alloc(self, req, upto):
        while len(req.blocks) * self.B < upto:
            b = self.free.pop(0)
            self.stats["reused"] += b in self.freed_once
            self.refs[b] = 1
            req.blocks.append(b)

    def _finish(self):
        for req in [r for r in self.reqs if r.written >= r.target]:
            for b in req.blocks:
                self.refs[b] -= 1
                if self.refs[b] == 0:
                    self.free.insert(0, b)  # most recently freed first: reuse comes soon
                    self.freed_once.add(b)
            self.reqs.remove(req)

    # --- one forward ----------------------------------------------------------------------------------------
    def batch_tensors(self, batch):
        """vLLM's per-step tensors (padded to the capacities) and the written slots."""
        B, dev = self.B, self.dev
        qsl, seq, ids, pos, sm, ntok = [0], [], [], [], [], []
        tok = torch.zeros(self.bs_cap, self.max_len, dtype=torch.int32)
        for r, (req, n) in enumerate(batch):
            p = req.written
            self._alloc(req, p + n)
            self.stats["chunked"] += p + n < len(req.tokens)
            self.stats["moved"] += self.last_rows.get(id(req), r) != r
            self.last_rows[id(req)] = r
            row = torch.zeros(self.max_blocks, dtype=torch.int32)
            row[: len(req.blocks)] = torch.tensor(req.blocks, dtype=torch.int32)
            self.block_table[r] = row.to(dev)
            ids += req.tokens[p : p + n]
            pos += list(range(p, p + n))
            sm += [req.blocks[q // B] * B + q % B for q in range(p, p + n)]
            qsl.append(qsl[-1] + n)
            seq.append(p + n)
            tok[r, : len(req.tokens)] = torch.tensor(req.tokens, dtype=torch.int32)
            ntok.append(len(req.tokens))
        pad_r, pad_t = self.bs_cap - len(batch), self.t_cap - len(ids)

        def t(xs, dtype):
            return torch.tensor(xs, dtype=dtype, device=dev)

        return (
            dict(
                block_table=self.block_table,
                seq_lens=t(seq + [0] * pad_r, torch.int32),
                query_start_loc=t(qsl + [qsl[-1]] * pad_r, torch.int32),  # vLLM repeats the end past num_reqs
                num_reqs=t([len(batch)], torch.int32),
                input_ids=t(ids + [0] * pad_t, torch.int32),
                positions=t(pos + [0] * pad_t, torch.int64),
                slot_mapping=t(sm + [-1] * pad_t, torch.int64),  # PAD_SLOT_ID
                token_ids=tok.to(dev),
                num_tokens=t(ntok + [0] * pad_r, torch.int32),
            ),
            sm,
        )

    def step(self, corrupt=None, batch=None, check_jax=False):
        """One forward over the scheduled batch (or ``batch``, a list of requests); ``corrupt(engine, batch,
        tensors)`` runs right before the plan. Returns the new ring rows and asserts byte parity."""
        if batch is None:
            batch = self._schedule()
        else:
            batch = [(r, self._take(r, self.t_cap)) for r in batch]
        x, slots = self.batch_tensors(batch)
        if corrupt is not None:
            corrupt(self, batch, x)
        plan_kw = vllm.plan_inputs(
            block_table=x["block_table"],
            seq_lens=x["seq_lens"],
            query_start_loc=x["query_start_loc"],
            block_size=self.B,
            req_to_token_out=self.r2t,
            num_reqs=x["num_reqs"],
            expected_tokens=x["token_ids"],
            expected_tokens_valid_lens=x["num_tokens"],
            expected_tokens_out=self.pool,
        )
        plan_kw.update(
            swa_window_size=0,
            full_to_swa_index_mapping=None,
            verify_capacity=self.verify_cap,
            kv_token_id_vs_position_offset=0,
        )
        write_kw = vllm.write_inputs(
            input_ids=x["input_ids"],
            positions=x["positions"],
            slot_mapping=x["slot_mapping"],
            query_start_loc=x["query_start_loc"],
            num_reqs=x["num_reqs"],
        )
        before = int(self.worlds["ours"]["state"].violation_write_index.item())
        for who, w in self.worlds.items():
            run = sglang.launch_canary_plan_kernels if who == "ours" else ref_plan
            extra = dict(path=self.path) if who == "ours" else {}
            run(verify_plan_out=w["vp"], write_plan_out=w["wp"], **plan_kw, **extra)
        if check_jax:
            self.assert_jax_adapter_agrees(x, plan_kw, write_kw)
        self._phase(TAG.HEAD_K_FULL, write_kw)
        if slots:  # the model writes K and V of the new tokens, every layer
            idx = torch.tensor(slots, dtype=torch.int64, device=self.dev)
            for layer in range(len(self.kv)):
                for which in (0, 1):
                    h = self.half(layer, which)
                    h[idx // self.B, idx % self.B] = torch.randn(len(slots), *h.shape[2:]).to(h.dtype).to(self.dev)
        self._phase(TAG.TAIL_K_FULL, write_kw)
        for req, n in batch:
            req.written += n
        self._finish()
        self.steps += 1
        self.assert_parity()
        st = self.worlds["ours"]["state"]
        after, cap = int(st.violation_write_index.item()), st.violation_ring.shape[0]
        return st.violation_ring[min(before, cap) : min(after, cap)].tolist()

    def _phase(self, tag, write_kw):
        run_phase(self.worlds, self.contexts, tag, write_kw, backend="pallas", path=self.path)

    def assert_parity(self):
        assert_parity(self.worlds, self.steps)

    def assert_jax_adapter_agrees(self, x, plan_kw, write_kw):
        """The JAX adapter (``from_block_tables``, a BlockTable read in the gather) gives the batch fields and
        the plans the torch adapter's dense ``req_to_token`` gives through the launcher."""
        h = {k: v.cpu().numpy() for k, v in x.items()}
        batch = from_block_tables(
            input_ids=h["input_ids"],
            positions=h["positions"],
            query_start_loc=h["query_start_loc"],
            seq_lens=h["seq_lens"],
            block_table=h["block_table"],
            block_size=self.B,
            num_reqs=int(h["num_reqs"][0]),
            slot_mapping=h["slot_mapping"],
            expected_tokens=h["token_ids"],
            expected_tokens_valid_lens=h["num_tokens"],
        )
        for name in ("req_pool_indices", "prefix_lens", "extend_seq_lens"):
            np.testing.assert_array_equal(I64(getattr(batch, name)), plan_kw[name].cpu().numpy(), err_msg=name)
        np.testing.assert_array_equal(I64(batch.out_cache_loc), write_kw["out_cache_loc"].cpu().numpy())
        vp, wp = build_plans(
            req_pool_indices=batch.req_pool_indices,
            prefix_lens=batch.prefix_lens,
            extend_seq_lens=batch.extend_seq_lens,
            req_to_token=batch.req_to_token,
            verify_capacity=self.verify_cap,
            write_req_capacity=self.bs_cap,
            req_to_verify_expected_tokens=batch.req_to_verify_expected_tokens,
            req_to_verify_expected_tokens_valid_lens=batch.req_to_verify_expected_tokens_valid_lens,
        )
        tv, tw = self.worlds["ours"]["vp"], self.worlds["ours"]["wp"]
        n = int(tv.verify_num_valid.item())
        assert int(np.asarray(vp.verify_num_valid)[0]) == n and int(np.asarray(vp.enable)[0]) == 1
        for f in ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions"):
            np.testing.assert_array_equal(I64(getattr(vp, f))[:n], getattr(tv, f)[:n].cpu().numpy(), err_msg=f)
        np.testing.assert_array_equal(
            I64(vp.verify_prev_slot_indices)[:n], tv.verify_prev_slot_indices[:n].cpu().numpy()
        )
        np.testing.assert_array_equal(I64(wp.write_offsets), tw.write_offsets.cpu().numpy())
        np.testing.assert_array_equal(I64(wp.write_seed_slot_indices), tw.write_seed_slot_indices.cpu().numpy())
        assert int(np.asarray(wp.write_num_valid_reqs)[0]) == int(tw.write_num_valid_reqs.item())

    def owners(self):
        """block -> the live requests holding it."""
        out: dict[int, list[Req]] = {}
        for r in self.reqs:
            for b in r.blocks:
                out.setdefault(b, []).append(r)
        return out


def _clean_run(eng, steps, check_jax=False):
    for _ in range(steps):
        assert eng.step(check_jax=check_jax) == [], eng.steps
    st = eng.worlds["ours"]["state"]
    assert st.kernel_run_counters[[HEAD, TAIL]].tolist() == [2 * steps, 2 * steps]  # a verify + a write each
    assert st.slot_run_counters[TAIL].item() > 50


def _flip_k_byte(eng):
    """(i) A flipped K byte of a slot one scheduled request alone uses -> one TAIL REAL_KV row; a flipped V
    byte (not a source) -> nothing. Both are undone afterwards."""
    hit = {}

    def corrupt(e, batch, x):
        owners = e.owners()
        req = next(r for r, _ in batch if any(len(owners[b]) == 1 for b in r.blocks[: r.written // e.B]))
        j = next(j for j, b in enumerate(req.blocks[: req.written // e.B]) if len(owners[b]) == 1)
        q = j * e.B + 1
        hit.update(slot=req.blocks[j] * e.B + 1, q=q, other=req.blocks[0] * e.B)
        e.flip(0, hit["slot"])
        e.flip(1, hit["other"])  # V half of a verified slot: outside the layer-0 K source

    rows = eng.step(corrupt=corrupt)
    assert [(r[0], r[1], r[2], r[7]) for r in rows] == [(TAIL, hit["slot"], hit["q"], REAL_KV)]
    eng.flip(0, hit["slot"])
    eng.flip(1, hit["other"])


def _remap_block(eng):
    """(ii) A block-table entry of a scheduled request remapped to another request's block: the remapped slots
    read the other request's records (position, token, and the chain at both block edges)."""
    want = set()

    def corrupt(e, batch, x):
        B, j = e.B, 1  # remap block 1 of a request whose blocks 0, 1 are full and whose position 2B is verified

        def donors(v):  # full blocks of other requests, at another block index
            return [
                (o, i)
                for o in e.reqs
                if o is not v
                for i, b in enumerate(o.blocks[: o.written // B])
                if b not in v.blocks and i != j
            ]

        r, v = next((r, v) for r, (v, _) in enumerate(batch) if v.written >= 2 * B + 1 and donors(v))
        cand = donors(v)
        o, i = cand[0]
        y = o.blocks[i]
        x["block_table"][r, j] = y
        for tag in (HEAD, TAIL):
            for k in range(B):
                bits = POSITION | (CHAIN if k == 0 else 0)
                bits |= TOKEN if v.tokens[j * B + k] != o.tokens[i * B + k] else 0
                want.add((tag, y * B + k, i * B + k, bits))
            want.add((tag, v.blocks[j + 1] * B, (j + 1) * B, CHAIN))

    rows = eng.step(corrupt=corrupt)
    got = [(r[0], r[1], r[2], r[7]) for r in rows]
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))


def _use_after_free(eng):
    """(iii) A block freed while a request still maps it, reused by a new request: the stale reader's next
    verify reads the new owner's records."""
    B, owners = eng.B, eng.owners()
    s = next(r for r in eng.reqs if r.written >= 2 * B + 1 and r.target > r.written and len(owners[r.blocks[1]]) == 1)
    x = s.blocks[1]
    eng.refs[x] = 0
    eng.free.insert(0, x)  # the bug: freed while s still maps it
    n = eng.new_request(tokens=[60000 + k for k in range(B)])  # a fresh prompt of one block: it gets block x
    assert eng.step(batch=[n]) == []  # the new owner writes its records into x: nothing verified there yet
    assert n.blocks == [x]
    want = set()
    for tag in (HEAD, TAIL):
        for k in range(B):  # the canary holds n's record (position k, token 60000 + k) where s expects B + k
            want.add((tag, x * B + k, k, POSITION | TOKEN | (CHAIN if k == 0 else 0)))
        want.add((tag, s.blocks[2] * B, 2 * B, CHAIN))  # s's next block chains from n's last record
    rows = eng.step(batch=[s])
    got = [(r[0], r[1], r[2], r[7]) for r in rows]
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))


def _run(layout, device="cpu", path="native", steps=8, faults=True, check_jax=False):
    eng = VllmEngine(seed=4, layout=layout, device=device, path=path)
    _clean_run(eng, steps, check_jax=check_jax)
    if faults:
        assert min(eng.stats.values()) > 0, eng.stats  # sharing, block reuse, chunked prefill, moving rows
        _flip_k_byte(eng)
        _remap_block(eng)
        assert eng.step() == []  # the remap was one step's table: clean again
        _use_after_free(eng)
    return eng


def test_engine_fused_kv_layout_native_cpu():
    """FlashInfer's ``[num_blocks, 2, block_size, heads, dim]``: clean run (also checked against the JAX
    adapter's plans), then the three faults."""
    _run("block_first", check_jax=True)


def test_engine_split_kv_layout_native_cpu():
    """FlashAttention's ``[2, num_blocks, block_size, heads, dim]``: clean run and a flipped K byte."""
    eng = _run("kv_first", steps=6, faults=False)
    _flip_k_byte(eng)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["block_first", "kv_first"])
@pytest.mark.parametrize("path", ["native", "dlpack"])
def test_engine_cuda(path, layout):
    _run(layout, device="cuda", path=path)


# --- the adapters alone -------------------------------------------------------------------------------------
def test_plan_inputs_example():
    bt = torch.tensor([[5, 7, 0], [3, 0, 0], [9, 9, 9], [4, 4, 4]], dtype=torch.int32)  # rows 2, 3: stale
    r2t = torch.full((5, 12), 77, dtype=torch.int32)
    r2t[0] = 0
    kw = vllm.plan_inputs(
        block_table=bt,
        seq_lens=torch.tensor([6, 3, 5, 0], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 2, 3, 3, 3], dtype=torch.int32),
        block_size=4,
        req_to_token_out=r2t,
        num_reqs=torch.tensor(2),
    )
    assert kw["req_pool_indices"].tolist() == [1, 2, 0, 0]
    assert kw["prefix_lens"].tolist() == [4, 2, 0, 0]
    assert kw["extend_seq_lens"].tolist() == [2, 1, 0, 0]
    assert kw["req_to_token"] is r2t and kw["req_to_verify_expected_tokens"] is None
    assert r2t[1].tolist() == [20, 21, 22, 23, 28, 29, 30, 31, 0, 0, 0, 0]  # the null block reads as slot 0
    assert r2t[2].tolist() == [12, 13, 14, 15] + [0] * 8
    assert r2t[0].tolist() == r2t[3].tolist() == r2t[4].tolist() == [0] * 12
    kw = vllm.plan_inputs(
        block_table=bt[:2],
        seq_lens=torch.tensor([6, 3]),
        query_start_loc=torch.tensor([0, 2, 3]),
        block_size=4,
        req_to_token_out=r2t,
        null_block=None,
    )
    assert r2t[2].tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 0, 1, 2, 3]
    w = vllm.write_inputs(
        input_ids=torch.tensor([11, 12, 21, 9], dtype=torch.int32),
        positions=torch.tensor([4, 5, 2, 9]),
        slot_mapping=torch.tensor([28, 29, 14, 33]),  # a stale slot past the live tokens
        query_start_loc=torch.tensor([0, 2, 3, 3, 3], dtype=torch.int32),
        num_reqs=2,
    )
    assert w["out_cache_loc"].tolist() == [28, 29, 14, -1] and w["input_ids"].dtype == torch.int64


@pytest.mark.parametrize("layout", ["block_first", "kv_first"])
def test_k_source_is_a_view_of_each_slot_k(layout):
    nb, bs, h, d = 5, 4, 2, 8
    shape = (nb, 2, bs, h, d) if layout == "block_first" else (2, nb, bs, h, d)
    kv = torch.randn(shape).to(torch.bfloat16)
    src = vllm.k_source(kv, layout=layout, block_size=bs)
    assert src.tensor.data_ptr() == kv.data_ptr() and (src.page_size, src.num_bytes_per_token) == (bs, h * d * 2)
    k = kv[:, 0] if layout == "block_first" else kv[0]
    u8 = src.tensor.view(torch.uint8)
    nbpt = src.num_bytes_per_token
    for s in range(nb * bs):
        got = u8[s // bs, (s % bs) * nbpt :][:nbpt]
        assert torch.equal(got, k[s // bs, s % bs].contiguous().view(torch.uint8).view(-1)), s
    if layout == "kv_first":
        v = vllm.v_source(kv, layout=layout)
        assert torch.equal(v.tensor.view(torch.uint8)[1, :nbpt], kv[1, 1, 0].contiguous().view(torch.uint8).view(-1))


def test_adapter_errors():
    fused = torch.zeros(4, 2, 4, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(
        ValueError,
        match=r"v_source: kv_cache \(shape .*layout='block_first'\): V starts 4 \* 32 bytes .* no row offset",
    ):
        vllm.v_source(fused, layout="block_first")
    hnd = torch.zeros(4, 2, 2, 4, 8, dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)  # vLLM's HND stride order
    with pytest.raises(ValueError, match=r"k_source: kv_cache \(shape \(4, 2, 4, 2, 8\) .* must be contiguous"):
        vllm.k_source(hnd, layout="block_first")
    with pytest.raises(ValueError, match=r"layout='kv_first'\) must have the layout's shape \[2, num_blocks, "):
        vllm.k_source(fused, layout="kv_first")
    with pytest.raises(ValueError, match=r"holds 8 bytes per slot and half"):
        vllm.k_source(torch.zeros(4, 2, 4, 1, 4, dtype=torch.bfloat16), layout="block_first")
    with pytest.raises(ValueError, match=r"holds 4 tokens per block, not block_size=8"):
        vllm.k_source(fused, layout="block_first", block_size=8)
    with pytest.raises(ValueError, match=r"layout must be one of"):
        vllm.k_source(fused, layout="NHD")
    base = dict(
        block_table=torch.zeros(2, 3, dtype=torch.int32),
        seq_lens=torch.tensor([1, 1]),
        query_start_loc=torch.tensor([0, 1, 2]),
        block_size=4,
        req_to_token_out=torch.zeros(3, 12, dtype=torch.int32),
    )
    vllm.plan_inputs(**base)
    cases = [
        (
            TypeError,
            r"plan_inputs: block_table must be a tensor of dtype int32 and shape \(any, any\), got shape \(2, 3\) "
            r"dtype torch.int64",
            dict(block_table=torch.zeros(2, 3, dtype=torch.int64)),
        ),
        (
            ValueError,
            r"req_to_token_out must be a tensor of dtype int32 and shape \(any, 12\), got shape \(3, 8\)",
            dict(req_to_token_out=torch.zeros(3, 8, dtype=torch.int32)),
        ),
        (
            ValueError,
            r"req_to_token_out must have at least 3 rows \(bs = 2\) and outputs .*, got shape \(2, 12\)",
            dict(req_to_token_out=torch.zeros(2, 12, dtype=torch.int32)),
        ),
        (
            ValueError,
            r"req_to_token_out must have .*contiguous, got shape \(3, 12\) dtype torch.int32 device cpu strides "
            r"\(1, 3\)",
            dict(req_to_token_out=torch.zeros(12, 3, dtype=torch.int32).t()),
        ),
        (ValueError, r"block_table must have at least 2 rows", dict(block_table=torch.zeros(1, 3, dtype=torch.int32))),
        (
            ValueError,
            r"query_start_loc must be a tensor of dtype int32/int64 and shape \(3,\)",
            dict(query_start_loc=torch.tensor([0, 1])),
        ),
        (ValueError, r"num_reqs must be an int in \[0, 2\]", dict(num_reqs=3)),
        (ValueError, r"block_size must be a positive int", dict(block_size=0)),
        (ValueError, r"go together", dict(expected_tokens=torch.zeros(2, 12, dtype=torch.int32))),
    ]
    for exc, msg, change in cases:
        with pytest.raises(exc, match=msg):
            vllm.plan_inputs(**{**base, **change})
