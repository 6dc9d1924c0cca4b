"""The native torch path inside a torch CUDA graph: plan, HEAD verify/write, the forward's KV write and TAIL
verify/write of a step captured once and replayed 100 times over a changing batch.

Every replay refills the captured input tensors (the batch's rows, prefix and extend lengths, tokens,
positions, slots and new K/V values) and must leave the canary state byte-identical to the independent
re-implementation of SGLang's torch references run eagerly on a cloned state. One replay runs on a KV pool
with a flipped byte and must report exactly the row SGLang would. Needs CUDA and the ``triton`` package.
"""

from __future__ import annotations

import pytest
import torch
from test_torch_engine import REAL_KV, TAG, TinyEngine

from helpers.torch_reference import ref_plan, ref_verify, ref_write
from interop import sglang
from interop.native import launch as native
from interop.native import replay, triton_kernels

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_kernels.triton_available()), reason="needs CUDA and triton"
)


class GraphEngine(TinyEngine):
    """TinyEngine whose canary launches (ours) run as one captured CUDA graph per step."""

    def __init__(self, seed: int, **kw):
        super().__init__(seed, device="cuda", path="native", num_slots=8192, max_reqs=12, **kw)
        t = lambda n: torch.zeros(n, dtype=torch.int64, device="cuda")  # noqa: E731
        self.static = dict(
            req_pool_indices=t(self.bs_cap),
            prefix_lens=t(self.bs_cap),
            extend_seq_lens=t(self.bs_cap),
            valid_lens=t(self.bs_cap),
            input_ids=t(self.t_cap),
            positions=t(self.t_cap),
            out_cache_loc=t(self.t_cap),
        )
        shape = (self.t_cap, *self.k[0].shape[1:])
        self.new_k = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in self.k]
        self.graph = None

    def _schedule(self):
        done = [r for r in self.reqs if len(r["tokens"]) >= self.r2t.shape[1] - 1]
        for r in done:  # retire full requests so the batch keeps changing for 100 steps
            self.reqs.remove(r)
            self.free_rows.append(r["row"])
        return super()._schedule()

    def _kw(self):
        st = self.static
        plan_kw = dict(
            req_pool_indices=st["req_pool_indices"],
            prefix_lens=st["prefix_lens"],
            extend_seq_lens=st["extend_seq_lens"],
            req_to_token=self.r2t,
            swa_window_size=0,
            full_to_swa_index_mapping=None,
            verify_capacity=self.verify_cap,
            req_to_verify_expected_tokens=self.pool,
            req_to_verify_expected_tokens_valid_lens=st["valid_lens"],
            kv_token_id_vs_position_offset=0,
        )
        write_kw = dict(
            input_ids=st["input_ids"],
            positions=st["positions"],
            out_cache_loc=st["out_cache_loc"],
            enable_write_input_assert=False,
            expected_input_tokens=None,
            expected_input_positions=None,
        )
        return plan_kw, write_kw

    def _ours(self):
        """The captured work: our plan and both phases, with the forward's KV write between them."""
        w, plan_kw, write_kw = self.worlds["ours"], *self._kw()
        sglang.launch_canary_plan_kernels(verify_plan_out=w["vp"], write_plan_out=w["wp"], path="native", **plan_kw)
        for tag in (TAG.HEAD_K_FULL, TAG.TAIL_K_FULL):
            if tag == TAG.TAIL_K_FULL:
                for layer, k in enumerate(self.k):
                    k.index_copy_(0, self.static["out_cache_loc"], self.new_k[layer])
            ctx = self.contexts["ours"][tag]
            sglang.launch_canary_verify_kernel(
                context=ctx, plan=w["vp"], check_verify_expected_token=True, backend=self.backend, path="native"
            )
            sglang.launch_canary_write_kernel(
                context=ctx, plan=w["wp"], backend=self.backend, path="native", **write_kw
            )

    def capture(self):
        """Builds every program on a scratch copy of the state (same shapes), then captures the step."""
        scratch = TinyEngine(seed=99, device="cuda", path="native", num_slots=8192, max_reqs=12)
        saved = (self.worlds["ours"], self.contexts["ours"], self.k)
        self.worlds["ours"], self.contexts["ours"], self.k = scratch.worlds["ours"], scratch.contexts["ours"], scratch.k
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._ours()  # warm-up: traces, lowers and compiles every program
        torch.cuda.current_stream().wait_stream(side)
        self.worlds["ours"], self.contexts["ours"], self.k = saved
        traces, captures = native.trace_count(), replay.GRAPHS.captures
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._ours()
        assert native.trace_count() == traces  # capture built nothing new
        assert replay.GRAPHS.captures == captures  # inside the caller's capture the launchers record eagerly

    def graph_step(self, corrupt=None, eager=False):
        """One step: the captured graph replayed, or (``eager``) the launchers called on the static tensors."""
        batch = self._schedule()
        if corrupt is not None:
            corrupt(self, batch)
        plan_kw, write_kw, loc = self.batch_inputs(batch)
        st = self.static
        for name in ("req_pool_indices", "prefix_lens", "extend_seq_lens"):
            st[name].copy_(plan_kw[name])
        st["valid_lens"].copy_(plan_kw["req_to_verify_expected_tokens_valid_lens"])
        for name in ("input_ids", "positions", "out_cache_loc"):
            st[name].copy_(write_kw[name])
        for layer, k in enumerate(self.k):
            new = k[st["out_cache_loc"]].clone()  # padding entries rewrite slot 0 with its own value
            n = len(loc)
            new[:n] = torch.randn(n, *k.shape[1:], device="cuda").to(torch.bfloat16)
            self.new_k[layer].copy_(new)
        before = int(self.worlds["ours"]["state"].violation_write_index.item())
        if eager:
            self._ours()
        else:
            self.graph.replay()
        # the reference world, eagerly, on the same inputs and the KV the replay's forward wrote (HEAD reads no KV)
        w, ctx = self.worlds["ref"], self.contexts["ref"]
        ref_plan(verify_plan_out=w["vp"], write_plan_out=w["wp"], **plan_kw)
        for tag in (TAG.HEAD_K_FULL, TAG.TAIL_K_FULL):
            ref_verify(context=ctx[tag], plan=w["vp"], check_verify_expected_token=True)
            ref_write(context=ctx[tag], plan=w["wp"], **write_kw)
        for req in batch:
            req["written"] = len(req["tokens"])
        self.steps += 1
        self.assert_parity()
        state = self.worlds["ours"]["state"]
        after = int(state.violation_write_index.item())
        cap = state.violation_ring.shape[0]
        return state.violation_ring[min(before, cap) : min(after, cap)].tolist()


def test_captured_step_replays_100_times_with_sglang_bytes_and_reports_a_fault():
    eng = GraphEngine(seed=3, backend="pallas")
    eng.capture()
    batches = set()
    for _ in range(100):
        assert eng.graph_step() == []
        batches.add(tuple(eng.static["prefix_lens"].tolist()) + tuple(eng.static["extend_seq_lens"].tolist()))
    assert len(batches) >= 90  # the batch really changed under the same graph (prefixes grow every step)
    st = eng.worlds["ours"]["state"]
    # each step launches verify and write under both tags, and each launch counts once under its tag
    assert st.kernel_run_counters[int(TAG.HEAD_K_FULL)].item() == 200
    assert st.kernel_run_counters[int(TAG.TAIL_K_FULL)].item() == 200

    hit = {}
    rows = eng.graph_step(corrupt=_flip(hit))
    assert [(r[0], r[1], r[2], r[7]) for r in rows] == [(int(TAG.TAIL_K_FULL), hit["slot"], hit["q"], REAL_KV)]


def _flip(hit):
    def flip(e, batch):
        counts = {}
        for _, _, s in e.used_slots():
            counts[s] = counts.get(s, 0) + 1
        req, q, slot = next((r, q, s) for r, q, s in e.used_slots() if r in batch and counts[s] == 1 and q > 0)
        e.k[0].view(e.k[0].shape[0], -1).view(torch.uint8)[slot, 3] ^= 0x40
        hit.update(slot=slot, q=q)

    return flip


def test_eager_launches_on_static_tensors_replay_their_own_graphs_with_sglang_bytes():
    """An engine that calls the launchers eagerly on the same tensors every step: from the second step on, each
    launch is one replay of a graph the launcher captured (no checks, no staging ops on the host), and the
    canary state stays byte-identical to SGLang's references; a flipped KV byte is still reported."""
    replay.GRAPHS.clear()
    eng = GraphEngine(seed=5, backend="pallas")
    captures, replays = replay.GRAPHS.captures, replay.GRAPHS.replays
    for _ in range(30):
        assert eng.graph_step(eager=True) == []
    # plan, and verify + write under HEAD and TAIL: five launch keys, captured at their second step
    assert replay.GRAPHS.captures - captures == 5
    assert replay.GRAPHS.replays - replays == 5 * 29
    traces = native.trace_count()
    hit = {}
    rows = eng.graph_step(corrupt=_flip(hit), eager=True)
    assert native.trace_count() == traces
    assert [(r[0], r[1], r[2], r[7]) for r in rows] == [(int(TAG.TAIL_K_FULL), hit["slot"], hit["q"], REAL_KV)]
    assert replay.GRAPHS.replays - replays == 5 * 30


def test_replay_off_runs_every_launch_eagerly_with_the_same_bytes(monkeypatch):
    monkeypatch.setenv(replay.GRAPHS_ENV, "0")
    replay.GRAPHS.clear()
    eng = GraphEngine(seed=6, backend="pallas")
    captures, replays = replay.GRAPHS.captures, replay.GRAPHS.replays
    for _ in range(4):
        assert eng.graph_step(eager=True) == []
    assert (replay.GRAPHS.captures, replay.GRAPHS.replays) == (captures, replays)
