"""Serve requests through sglang-jax 0.0.2's own scheduler and pools on CPU, with the canary on; no model.

sglang-jax's own code does the serving: ``Scheduler.get_next_batch_to_run`` / ``run_batch`` /
``process_batch_result`` / ``check_memory`` (the body of ``Scheduler.event_loop_normal``, managers/scheduler.py),
``SchedulePolicy`` / ``PrefillAdder`` (admission, chunked prefill), ``ScheduleBatch`` / ``ModelWorkerBatch`` /
``ForwardBatch.init_new``, ``ReqToTokenPool`` + ``MHATokenToKVPool`` + the token or paged allocator built as
``ModelRunner.init_memory_pool`` builds them, ``RadixCache`` (prefix reuse, eviction, frees), ModelWorker's own
padding code, and the KV write ``MHATokenToKVPool.set_kv_buffer_legacy`` + ``kv_buffer[layer] = ...`` (what
``NativeAttention`` and ``ModelRunner._set_kv_cache_after_forward`` do off TPU).

Ours: :class:`FakeWorker` (stands where ``ModelWorker`` stands: deterministic K/V from (layer, token,
position), next token from the last token and position), the Scheduler's constructor (the real one opens zmq
sockets and loads a tokenizer and a model), ``stream_output`` (zmq to the detokenizer), the workload, and the
canary around each forward (step API: ``canary_plan`` / ``canary_head`` / write / ``canary_tail``), sized and
fed by :func:`canary_jax.adapters.sglang_jax_pools.sglang_jax_pools` from the pool objects themselves.
A ``fault`` hook runs as ``fault(server, None)`` at the start of each iteration (to edit the pool, tables,
allocator or radix tree before the scheduler builds the batch) and as ``fault(server, forward_batch) ->
forward_batch`` before each forward's canary (to edit what the model is fed).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # jax[tpu] installs libtpu; keep it quiet on a CPU

import fake_model
import jax
import jax.numpy as jnp
import numpy as np
from fake_model import VOCAB, fake_kv, next_token  # noqa: F401  (VOCAB, next_token: the tests read them here)
from sgl_jax.srt.managers.schedule_batch import Req, ScheduleBatch
from sgl_jax.srt.managers.schedule_policy import SchedulePolicy
from sgl_jax.srt.managers.scheduler import Scheduler
from sgl_jax.srt.managers.tp_worker import ModelWorker
from sgl_jax.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from sgl_jax.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sgl_jax.srt.mem_cache.radix_cache import RadixCache
from sgl_jax.srt.model_executor.forward_batch_info import ForwardBatch
from sgl_jax.srt.sampling.sampling_params import SamplingParams
from sgl_jax.srt.utils.common_utils import PRECOMPILE_DEFAULT_BS_PADDINGS
from sgl_jax.srt.utils.mesh_utils import create_device_mesh

from canary_jax.adapters.sglang_jax_pools import sglang_jax_pools
from canary_jax.contract.decode import ViolationRecord, decode_violations
from canary_jax.runtime import (
    CanaryState,
    ExpectedInputs,
    RealKvHashMode,
    canary_head,
    canary_plan,
    canary_tail,
)

logging.getLogger("sgl_jax").setLevel(logging.WARNING)  # its per-batch INFO lines


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ServeConfig:
    """One serving run: pool and scheduler sizes (sglang-jax's server args) and the canary's mode."""

    page_size: int = 4
    pool_tokens: int = 160
    max_running: int = 4
    chunked_prefill_size: int = 16
    max_prefill_tokens: int = 64
    context_len: int = 96
    layers: int = 2
    heads: int = 2
    head_dim: int = 128
    # sglang-jax's --precompile-bs-paddings: one bucket (the largest) keeps every batch one shape, so the canary
    # compiles once per page size (each compile costs tens of seconds of a loaded CI core); None = its defaults
    precompile_bs_paddings: tuple[int, ...] | None = (4,)
    real_kv_hash_mode: str = "ALL"  # NONE, PARTIAL or ALL
    # "step": the step API around the write (canary_plan / canary_head / write / canary_tail); "guard": one
    # CanaryGuard (SglangJaxPools.guard) runs plan, HEAD, the write and TAIL, reporting one step late
    canary: str = "step"
    seed: int = 0


def workload(seed: int) -> list[tuple[int, str, list[int], int]]:
    """``(arrival_iteration, rid, prompt, max_new_tokens)``: two shared system prefixes (21 and 12 tokens, not
    page-aligned), long prompts (chunked at 16), and an exact repeat of r00 (a full-prefix radix hit)."""
    return fake_model.workload(seed, prefix_tokens=(21, 12))


def guard_write(kv_buffer, inputs):
    """The guard's ``write_fn``: the pool's own write (``MHATokenToKVPool.set_kv_buffer_legacy``) on the traced
    ``kv_buffer`` list, K/V from :func:`fake_kv`. Module-level, so every guard shares its programs."""
    heads, dim = kv_buffer[0].shape[1] // 2, kv_buffer[0].shape[2]
    view = SimpleNamespace(kv_buffer=list(kv_buffer), start_layer=0)  # the fields the write reads
    for layer in range(len(kv_buffer)):
        k, v = fake_kv(layer, inputs.input_ids, inputs.positions, heads, dim)
        view.kv_buffer[layer] = MHATokenToKVPool.set_kv_buffer_legacy(view, layer, inputs.out_cache_loc, k, v)
    return view.kv_buffer


class _ListLogger(logging.Logger):
    """The guard's logger: keeps its warnings (SGLang's violation text) in a list."""

    def __init__(self, sink: list[str]):
        super().__init__("canary_jax.sgl_serving")
        self.sink = sink

    def warning(self, msg, *args, **kw):
        self.sink.append(msg % args if args else msg)


class FakeWorker:
    """Stands where ``ModelWorker`` stands (tp_worker.py); borrows its padding code."""

    get_max_padded_size = ModelWorker.get_max_padded_size
    normalize_token_paddings = ModelWorker.normalize_token_paddings
    get_precompile_paddings = ModelWorker.get_precompile_paddings

    def __init__(self, server: Server, max_running_requests: int, max_req_len: int):
        cfg = server.cfg
        self.server = server
        self.page_size = cfg.page_size
        self.max_prefill_tokens = cfg.max_prefill_tokens
        self.chunked_prefill_size = cfg.chunked_prefill_size
        self.max_running_requests = max_running_requests
        self.max_req_len = max_req_len
        self.max_padded_batch_size, self.max_padded_num_tokens = self.get_max_padded_size()
        self.precompile_token_paddings = None
        self.normalize_token_paddings()  # as ModelWorker.__init__
        # server_args.precompile_bs_paddings, as ModelWorker.__init__ reads it
        listed = cfg.precompile_bs_paddings or PRECOMPILE_DEFAULT_BS_PADDINGS
        bs = sorted(b for b in listed if b <= self.max_padded_batch_size)
        if not bs or bs[-1] < self.max_padded_batch_size:
            bs.append(self.max_padded_batch_size)
        self.precompile_bs_paddings = bs
        ps = cfg.page_size
        self.precompile_cache_loc_paddings = [(b * max_req_len + ps - 1) // ps * ps for b in bs]
        self.model_runner = SimpleNamespace(mesh=server.mesh, attn_backend=None)  # all ForwardBatch reads

    def get_model_runner(self):
        return self.model_runner

    def forward_batch_generation(self, mwb, launch_done=None, skip_sample=False, sampling_metadata=None):
        fb = ForwardBatch.init_new(mwb, self.model_runner)  # as ModelWorker.forward_batch_generation
        fb = self.server.forward(mwb, fb)
        ids, pos = np.asarray(fb.input_ids), np.asarray(fb.positions)
        if fb.forward_mode.is_decode():
            last = np.arange(mwb.real_bs)
        else:
            last = mwb.extend_start_loc[: mwb.real_bs] + mwb.extend_seq_lens[: mwb.real_bs] - 1
        return None, np.array([next_token(int(ids[i]), int(pos[i])) for i in last], np.int32), 0


class DriveScheduler(Scheduler):
    """sglang-jax's Scheduler with a constructor that needs no zmq, tokenizer or model."""

    def __init__(self, server: Server, worker: FakeWorker, max_total_num_tokens: int):
        cfg = server.cfg
        self.server_args = SimpleNamespace(
            page_size=cfg.page_size, decode_log_interval=10**9, disable_radix_cache=False, max_seq_len=cfg.context_len
        )
        self.page_size, self.enable_overlap, self.is_generation = cfg.page_size, False, True
        self.mesh, self.tp_worker = server.mesh, worker
        self.model_config = SimpleNamespace(vocab_size=VOCAB)
        self.max_total_num_tokens = max_total_num_tokens
        self.max_prefill_tokens = cfg.max_prefill_tokens
        self.max_running_requests = worker.max_running_requests
        self.max_req_len, self.max_req_input_len = worker.max_req_len, worker.max_req_len - 5
        # Scheduler.init_memory_pool_and_cache
        self.req_to_token_pool, self.token_to_kv_pool_allocator = server.req_to_token_pool, server.allocator
        self.tree_cache = RadixCache(
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            page_size=cfg.page_size,
            kv_head_num=cfg.heads,
            head_dim=cfg.head_dim,
            layer_num=cfg.layers,
            max_seq_len=cfg.context_len,
        )
        self.decode_mem_cache_buf_multiplier = 1
        self.waiting_queue, self.aborted_reqs = [], {}
        self.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
        self.cur_batch = self.last_batch = None
        self.forward_ct = self.forward_ct_decode = self.num_generated_tokens = self.last_prefill_tokens = 0
        self.last_decode_stats_tic = self.last_prefill_stats_tic = time.perf_counter()
        self.num_retracted_reqs = self.num_paused_reqs = 0
        self.chunked_prefill_size = cfg.chunked_prefill_size
        self.chunked_req, self.is_mixed_chunk = None, False
        self.policy = SchedulePolicy("fcfs", self.tree_cache)
        self.init_new_token_ratio, self.min_new_token_ratio = 0.7, 0.1  # global_config defaults
        self.new_token_ratio_decay = (0.7 - 0.1) / 600
        self.new_token_ratio = self.init_new_token_ratio
        self.profiler_target_forward_ct = self.profiler_start_forward_ct = None
        self.outputs = {}

    def stream_output(self, reqs, return_logprob, skip_req=None, cache_miss_count=None):
        for r in reqs:  # the real one sends BatchTokenIDOut to the detokenizer over zmq
            if r.finished():
                self.outputs[r.rid] = list(r.output_ids)


class Server:
    """sglang-jax's pools, allocator, radix cache and scheduler, with the canary around every forward."""

    def __init__(self, cfg: ServeConfig, *, fault: Callable[[Server, Any], Any] | None = None):
        self.cfg, self.fault = cfg, fault
        ps = cfg.page_size
        self.mesh = create_device_mesh(ici_parallelism=[-1, 1, 1], dcn_parallelism=[1, 1, 1])
        jax.sharding.set_mesh(self.mesh)  # set_kv_buffer's shard_map needs a context mesh (the package's tests)
        size = cfg.pool_tokens // ps * ps  # ModelRunner.init_memory_pool
        self.req_to_token_pool = ReqToTokenPool(
            size=cfg.max_running * 2 + 1, max_context_len=cfg.context_len + 4, dtype=np.int32
        )
        self.pool = MHATokenToKVPool(
            size=size,
            page_size=ps,
            dtype=jnp.bfloat16,
            head_num=cfg.heads,
            head_dim=cfg.head_dim,
            layer_num=cfg.layers,
            mesh=self.mesh,
        )
        if ps == 1:
            self.allocator = TokenToKVPoolAllocator(size=size, kvcache=self.pool)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(size=size, page_size=ps, kvcache=self.pool, debug_mode=True)
        max_req_len = min(cfg.context_len - 1, size - 1)
        running = min(size // 2, self.req_to_token_pool.size, cfg.max_running)
        self.worker = FakeWorker(self, running, max_req_len)
        self.sched = DriveScheduler(self, self.worker, size)
        # the canary, sized from the pool objects themselves
        self.canary = sglang_jax_pools(self.pool, self.req_to_token_pool, allocator=self.allocator)
        self.config = self.canary.step_config(
            real_kv_hash_mode=RealKvHashMode.from_name(cfg.real_kv_hash_mode),
            enable_write_input_assert=True,
            enable_verify_token_assert=True,
        )
        self.state = CanaryState.create(self.canary.groups(), ring_capacity=256)
        self.guard = None
        self.guard_logs: list[str] = []  # the guard's log-mode warnings (SGLang's text)
        if cfg.canary == "guard":
            self.guard = self.canary.guard(
                guard_write,
                real_kv_hash_mode=self.config.real_kv_hash_mode,
                mode="log",
                ring_capacity=256,
                enable_write_input_assert=True,
                enable_verify_token_assert=True,
                on_violations=self._guard_records,
                log=_ListLogger(self.guard_logs),
            )
        elif cfg.canary != "step":
            raise ValueError(f"ServeConfig.canary must be 'step' or 'guard', got {cfg.canary!r}")
        self.it, self.forwards, self.seen = 0, [], 0
        self.prefix_hits = self.chunked = self.reused_slots = 0  # extend rows with a radix prefix, chunked rows
        self.written: set[int] = set()
        self.violations: list[tuple[int, ViolationRecord]] = []  # (iteration, record)
        self.workload = workload(cfg.seed)

    # ---------------------------------------------------------------------------------------- one forward
    def expected(self, mwb) -> tuple[ExpectedInputs, np.ndarray, np.ndarray]:
        """The requests' own tokens (``Req.origin_input_ids + output_ids``): the write-input and verify-token
        oracle, per token and per ``req_to_token`` row."""
        reqs = self.sched.cur_batch.reqs
        t = len(mwb.input_ids)
        tokens, positions = np.zeros(t, np.int32), np.zeros(t, np.int32)
        pool = np.zeros(self.req_to_token_pool.req_to_token.shape, np.int32)
        valid = np.zeros(len(mwb.seq_lens), np.int32)
        off = 0
        for i, req in enumerate(reqs):
            seq = int(mwb.seq_lens[i])
            full = (req.origin_input_ids + req.output_ids)[:seq]
            ext = 1 if mwb.forward_mode.is_decode() else int(mwb.extend_seq_lens[i])
            tokens[off : off + ext] = full[seq - ext :]
            positions[off : off + ext] = np.arange(seq - ext, seq)
            pool[req.req_pool_idx, :seq] = full
            valid[i] = seq
            off += ext
        return ExpectedInputs(tokens=tokens, positions=positions), pool, valid

    def forward(self, mwb, fb):
        ex, pool, valid = self.expected(mwb)
        if self.fault is not None:
            fb = self.fault(self, fb)
        batch = self.canary.batch(fb, expected_inputs=ex, expected_tokens=pool, expected_tokens_valid_lens=valid)
        if self.guard is not None:
            return self._guarded_forward(mwb, fb, batch)
        plans = canary_plan(self.state, batch, config=self.config)
        self.state, plans = canary_head(self.state, batch, config=self.config, plans=plans)
        with jax.set_mesh(self.mesh):  # as ModelRunner._forward_raw (jax 0.8 has no use_mesh)
            for layer in range(self.pool.layer_num):
                k, v = fake_kv(layer, fb.input_ids, fb.positions, self.pool.head_num, self.pool.head_dim)
                self.pool.kv_buffer[layer] = self.pool.set_kv_buffer_legacy(layer, fb.out_cache_loc, k, v)
        sources = self.canary.sources(self.pool.kv_buffer)
        self.state, _ = canary_tail(self.state, plans, batch, config=self.config, real_kv_sources=sources)
        records = decode_violations(self.state.log, start=self.seen)
        self.seen += len(records)
        self.violations += [(self.it, r) for r in records]
        return self._account(mwb, fb)

    def _guarded_forward(self, mwb, fb, batch):
        """The guard's path: one program (plan, HEAD, :func:`guard_write`, TAIL); records arrive one step late
        through ``on_violations``."""
        with jax.set_mesh(self.mesh):
            self.pool.kv_buffer = self.guard.step(self.pool.kv_buffer, batch)
        return self._account(mwb, fb)

    def _guard_records(self, records, *, step):
        it = self.forwards[step][0]  # the iteration of guard step ``step`` (one forward per step)
        self.violations += [(it, r) for r in records]

    def _account(self, mwb, fb):
        self.forwards.append((self.it, fb.forward_mode.name, [r.rid for r in self.sched.cur_batch.reqs]))
        reqs = self.sched.cur_batch.reqs
        if not fb.forward_mode.is_decode():
            self.prefix_hits += sum(int(mwb.extend_prefix_lens[i]) > 0 for i in range(len(reqs)))
            self.chunked += sum(bool(r.is_chunked) for r in reqs)
        loc = np.asarray(mwb.out_cache_loc)
        new = {int(x) for x in loc[loc >= 0]}
        self.reused_slots += len(new & self.written)
        self.written |= new
        return fb

    # ---------------------------------------------------------------------------------------- the loop
    def run(self, *, until: int | None = None, stop: Callable[[Server], bool] | None = None) -> Server:
        """Scheduler.event_loop_normal's body until the workload drains (or iteration ``until``, or ``stop``)."""
        sched = self.sched
        last_arrival = max(w[0] for w in self.workload)
        while True:
            drained = not sched.waiting_queue and sched.running_batch.is_empty() and sched.chunked_req is None
            if (self.it > last_arrival and drained) or (until is not None and self.it >= until):
                break
            if stop is not None and stop(self):
                break
            if self.it > last_arrival + 400:
                raise RuntimeError("sglang-jax scheduler did not drain the workload")
            for _, rid, prompt, mnt in (w for w in self.workload if w[0] == self.it):
                sp = SamplingParams(max_new_tokens=mnt, ignore_eos=True, temperature=0.0)
                sp.normalize(None)  # as the tokenizer manager does
                req = Req(rid, "", list(prompt), sp, vocab_size=VOCAB)
                req.logprob_start_len = len(req.origin_input_ids) - 1  # Scheduler.handle_generate_request
                sched._add_request_to_queue(req)
            if self.fault is not None:
                self.fault(self, None)
            batch = sched.get_next_batch_to_run()
            sched.cur_batch = batch
            if batch:
                sched.process_batch_result(batch, sched.run_batch(batch))
            else:
                sched.check_memory()  # raises on a leaked token or request slot
                sched.new_token_ratio = sched.init_new_token_ratio
            sched.last_batch = batch
            self.it += 1
        return self
