"""A small plain-torch paged-KV "engine" calling the SGLang drop-in launchers every step.

The engine keeps everything in torch: an L-layer K/V pool ``[num_slots, heads, head_dim]`` (bf16), a slot
allocator (slot 0 reserved for padding), ``req_to_token`` (int32), an expected-token pool, requests that share
prefixes radix-style (a new request's first positions map to a donor's slots), and the canary state (HEAD and
TAIL K buffers, ring, per-tag counters). Each step is SGLang's per-forward sequence::

    launch_canary_plan_kernels -> HEAD verify -> HEAD write -> forward (random K/V writes, every layer)
                               -> TAIL verify (real-KV of layer 0) -> TAIL write

Every step also runs on a cloned canary state through the independent re-implementation of SGLang's torch
references, and all canary tensors must match byte for byte. A clean run records no violation; a flipped
KV byte and a remapped ``req_to_token`` entry show up as exactly the rows SGLang would record.
"""

from __future__ import annotations

import random

import pytest
import torch

from helpers.engine_worlds import assert_parity, make_worlds, run_phase
from helpers.torch_reference import ref_plan
from interop import sglang

TAG = sglang.CanaryLaunchTag
CHAIN, POSITION, REAL_KV, TOKEN = 1, 2, 4, 32


class TinyEngine:
    def __init__(
        self,
        seed: int,
        *,
        device="cpu",
        backend=None,
        path=None,
        num_slots=1024,
        layers=3,
        heads=2,
        head_dim=16,
        max_reqs=10,
        max_len=96,
        bs_cap=6,
        t_cap=48,
        verify_cap=384,
        ring=64,
    ):
        self.rng = random.Random(seed)
        self.dev, self.backend, self.path = device, backend, path
        self.bs_cap, self.t_cap, self.verify_cap = bs_cap, t_cap, verify_cap
        g = torch.Generator().manual_seed(seed)
        self.k = [
            torch.randn(num_slots, heads, head_dim, generator=g).to(torch.bfloat16).to(device) for _ in range(layers)
        ]
        self.v = [
            torch.randn(num_slots, heads, head_dim, generator=g).to(torch.bfloat16).to(device) for _ in range(layers)
        ]
        self.free = list(range(1, num_slots))
        self.r2t = torch.zeros(max_reqs, max_len, dtype=torch.int32, device=device)
        self.pool = torch.zeros(max_reqs, max_len, dtype=torch.int32, device=device)
        self.free_rows = list(range(1, max_reqs))
        self.reqs: list[dict] = []
        nbpt = heads * head_dim * 2
        # layer-0 K as SGLang's pool patch exposes it: [rows, bytes_per_row], page_size 1, ALL mode
        self.k0_source = sglang.RealKvSource(
            tensor=self.k[0].view(num_slots, heads * head_dim), page_size=1, num_bytes_per_token=nbpt, read_bytes=nbpt
        )
        # two identical canary worlds: ours (launchers) and ref (re-implemented SGLang references)
        self.worlds, self.contexts = make_worlds(
            num_slots=num_slots,
            ring=ring,
            verify_cap=verify_cap,
            bs_cap=bs_cap,
            k0_source=self.k0_source,
            device=device,
        )
        self.steps = 0

    # --- scheduling -------------------------------------------------------------------------------------
    def _new_request(self):
        if not self.free_rows:
            return None
        row = self.free_rows.pop(0)
        donors = [r for r in self.reqs if r["written"] >= 4]
        tokens, shared = [], 0
        if donors and self.rng.random() < 0.7:
            d = self.rng.choice(donors)
            shared = self.rng.randint(2, d["written"])
            tokens = d["tokens"][:shared]
            self.r2t[row, :shared] = self.r2t[d["row"], :shared]
        prompt = self.rng.randint(shared + 1, shared + 12)
        tokens = tokens + [self.rng.randrange(50000) for _ in range(prompt - len(tokens))]
        req = {"row": row, "tokens": tokens, "written": shared}
        self.reqs.append(req)
        return req

    def _schedule(self):
        if len(self.reqs) < self.bs_cap and (not self.reqs or self.rng.random() < 0.6):
            self._new_request()
        batch, budget = [], self.t_cap
        for req in self.reqs:
            if len(batch) == self.bs_cap:
                break
            if req["written"] == len(req["tokens"]):
                req["tokens"].append(self.rng.randrange(50000))  # decode: one new token
            n = len(req["tokens"]) - req["written"]
            if n <= budget and len(req["tokens"]) <= self.r2t.shape[1]:
                batch.append(req)
                budget -= n
        return batch

    # --- one forward --------------------------------------------------------------------------------------
    def step(self, corrupt=None):
        """Runs one forward; ``corrupt(engine, batch)`` runs right before the plan. Returns the new ring rows
        (SGLang's int64 rows as lists) and asserts byte parity with the reference world."""
        batch = self._schedule()
        if corrupt is not None:
            corrupt(self, batch)
        plan_kw, write_kw, loc = self.batch_inputs(batch)
        before = int(self.worlds["ours"]["state"].violation_write_index.item())
        for who in ("ours", "ref"):
            w = self.worlds[who]
            if who == "ours":
                sglang.launch_canary_plan_kernels(
                    verify_plan_out=w["vp"], write_plan_out=w["wp"], path=self.path, **plan_kw
                )
            else:
                ref_plan(verify_plan_out=w["vp"], write_plan_out=w["wp"], **plan_kw)
        self._phase(TAG.HEAD_K_FULL, write_kw)
        for layer in range(len(self.k)):  # the model forward writes K/V of the new tokens
            idx = torch.tensor(loc, dtype=torch.int64, device=self.dev)
            if len(loc):
                self.k[layer][idx] = torch.randn(len(loc), *self.k[layer].shape[1:]).to(torch.bfloat16).to(self.dev)
                self.v[layer][idx] = torch.randn(len(loc), *self.v[layer].shape[1:]).to(torch.bfloat16).to(self.dev)
        self._phase(TAG.TAIL_K_FULL, write_kw)
        for req in batch:
            req["written"] = len(req["tokens"])
        self.steps += 1
        self.assert_parity()
        st = self.worlds["ours"]["state"]
        after = int(st.violation_write_index.item())
        cap = st.violation_ring.shape[0]
        return st.violation_ring[min(before, cap) : min(after, cap)].tolist()

    def batch_inputs(self, batch):
        """Allocates the batch's new slots; returns the plan and write keyword arguments (padded to the
        capacities) and the written slots."""
        rpi, prefix, extend, ids, pos, loc = [], [], [], [], [], []
        for req in batch:
            p, e = req["written"], len(req["tokens"]) - req["written"]
            slots = [self.free.pop(0) for _ in range(e)]
            self.r2t[req["row"], p : p + e] = torch.tensor(slots, dtype=torch.int32)
            self.pool[req["row"], : len(req["tokens"])] = torch.tensor(req["tokens"], dtype=torch.int32)
            rpi.append(req["row"]), prefix.append(p), extend.append(e)
            ids += req["tokens"][p:]
            pos += list(range(p, p + e))
            loc += slots
        pad_r, pad_t = self.bs_cap - len(batch), self.t_cap - len(ids)
        t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.dev)  # noqa: E731
        plan_kw = dict(
            req_pool_indices=t(rpi + [0] * pad_r),
            prefix_lens=t(prefix + [0] * pad_r),
            extend_seq_lens=t(extend + [0] * pad_r),
            req_to_token=self.r2t,
            swa_window_size=0,
            full_to_swa_index_mapping=None,
            verify_capacity=self.verify_cap,
            req_to_verify_expected_tokens=self.pool,
            req_to_verify_expected_tokens_valid_lens=t(prefix + [0] * pad_r),
            kv_token_id_vs_position_offset=0,
        )
        write_kw = dict(
            input_ids=t(ids + [0] * pad_t),
            positions=t(pos + [0] * pad_t),
            out_cache_loc=t(loc + [0] * pad_t),
            enable_write_input_assert=False,
            expected_input_tokens=None,
            expected_input_positions=None,
        )
        return plan_kw, write_kw, loc

    def _phase(self, tag, write_kw):
        run_phase(self.worlds, self.contexts, tag, write_kw, backend=self.backend, path=self.path)

    def assert_parity(self):
        assert_parity(self.worlds, self.steps)

    def used_slots(self):
        """(request, position, slot) of every written position, shared slots listed once per request."""
        return [(req, q, int(self.r2t[req["row"], q])) for req in self.reqs for q in range(req["written"])]


def _run_engine(device, backend=None, path=None):
    eng = TinyEngine(seed=1, device=device, backend=backend, path=path)
    for _ in range(6):
        assert eng.step() == []
    st = eng.worlds["ours"]["state"]
    assert st.kernel_run_counters[[0, 2]].tolist() == [12, 12]  # a verify and a write per step
    assert st.slot_run_counters[2].item() > 50  # TAIL verify + write entries

    def slot_use():
        counts = {}
        for _, _, s in eng.used_slots():
            counts[s] = counts.get(s, 0) + 1
        return counts

    assert sum(c > 1 for c in slot_use().values()) >= 4  # requests share prefix slots

    # (a) a flipped byte of layer-0 K in a slot that one scheduled request alone uses -> one TAIL real-KV row
    hit = {}

    def flip(e, batch):
        counts = slot_use()
        req, q, slot = next((r, q, s) for r, q, s in e.used_slots() if r in batch and counts[s] == 1 and q > 0)
        e.k[0].view(e.k[0].shape[0], -1).view(torch.uint8)[slot, 3] ^= 0x40
        hit.update(slot=slot, q=q)

    rows = eng.step(corrupt=flip)
    assert [(r[0], r[1], r[2], r[7]) for r in rows] == [(int(TAG.TAIL_K_FULL), hit["slot"], hit["q"], REAL_KV)]

    # (b) req_to_token remapped: position q of a scheduled request now names another request's slot
    def remap(e, batch):
        counts = slot_use()
        q = 2
        victim = next(
            r
            for r in batch
            if r["written"] >= 6 and counts[int(e.r2t[r["row"], q])] == 1 and counts[int(e.r2t[r["row"], q + 1])] == 1
        )
        old, nxt = int(e.r2t[victim["row"], q]), int(e.r2t[victim["row"], q + 1])
        other = next(s for r, qq, s in e.used_slots() if qq != q and s not in (old, nxt, hit["slot"]))
        e.r2t[victim["row"], q] = other
        hit.update(other=other, nxt=nxt)

    rows = eng.step(corrupt=remap)
    got = {(r[0], r[1], r[7]) for r in rows}
    want = set()
    for tag in (int(TAG.HEAD_K_FULL), int(TAG.TAIL_K_FULL)):
        want |= {(tag, hit["other"], CHAIN | POSITION | TOKEN), (tag, hit["nxt"], CHAIN)}
    assert want <= got, (want, got)
    # the only other row allowed: the flipped KV byte again, if its request was scheduled
    assert got - want <= {(int(TAG.TAIL_K_FULL), hit["slot"], REAL_KV)}, got - want


def test_engine_clean_run_and_detects_corruption_cpu():
    _run_engine("cpu")


def test_engine_native_path_cpu():
    """The native torch path (torch ops; the Pallas kernels interpreted by JAX on CPU) gives SGLang's bytes."""
    _run_engine("cpu", "pallas", path="native")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("backend", "path"), [("reference", "dlpack"), ("pallas", "dlpack"), ("pallas", "native")])
def test_engine_clean_run_and_detects_corruption_cuda(backend, path):
    # the reference backend's serial loops are `while` loops, which the native path refuses (NotNative, pinned in
    # test_native_path.py), so it runs on the DLPack path only
    _run_engine("cuda", backend, path)
