"""Serve requests through EasyDeL 0.3.0 eSurge's own scheduler, page manager and ragged-page KV cache on CPU, with
the canary on; no model.

eSurge's own code does the serving: ``Scheduler.schedule`` / ``update_from_output`` (scheduler/scheduler.py:
admission, chunked prefill, prefix caching, preemption) over its ``CacheManager`` / page pool (core/), the runner's
own state update ``eSurgeRunner._update_states`` (runners/model_runner.py) over its ``SequenceBuffer`` and
``MultiGroupPageTable``, ``BatchMetadataPreparer.prepare_batch_metadata`` (the host metadata: query_start_loc,
seq_lens, page tables, the v2 slot mapping), the ``RaggedPagesMetadata`` built as the model executor's
``_backbone_step`` builds it, ``RaggedPagesCache.init_cache`` (caching/ragged_page/cache.py, v2 layout
``[num_pages, page_size, 2 * num_kv_heads, head_dim]``, K head ``h`` at combined head ``2h``) and the KV write
``RaggedPagesCacheView.concatenate_to_cache`` (``kv_cache_update_jax``, eSurge's v2 writer off GPU).

Ours: :class:`Runner` (stands where ``eSurgeRunner`` stands: it owns the sequence buffer and calls the runner's
own ``_update_states`` on itself; K/V from (layer, token, position), next token from the last token and
position, the sync runner's token write-back), the workload, and the canary around each forward (step API:
``canary_plan`` / ``canary_head`` / write / ``canary_tail``), fed by :func:`canary_jax.adapters.block_tables.
from_block_tables` with the preparer's own fields and :func:`canary_jax.adapters.layouts.sources_for_fused_kv`.
A ``fault`` hook runs as ``fault(server, None)`` before each step's metadata is built (to edit the cache, page
table or buffer) and as ``fault(server, fields) -> fields`` before the canary (to edit what the canary is fed).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import fake_model
import jax
import jax.numpy as jnp
import numpy as np
from easydel.caching.ragged_page import cache as rp
from easydel.inference.esurge.config import CacheConfig, Config, SchedulerConfig
from easydel.inference.esurge.core.interface import CacheGroupsConfig, CacheGroupSpec, FullAttentionSpec
from easydel.inference.esurge.outputs import ModelRunnerOutput
from easydel.inference.esurge.request import EngineRequest
from easydel.inference.esurge.runners.executors.batch_preparer import BatchMetadataPreparer
from easydel.inference.esurge.runners.model_runner import eSurgeRunner
from easydel.inference.esurge.runners.sequence_buffer import SequenceBuffer
from easydel.inference.esurge.scheduler.scheduler import Scheduler
from easydel.inference.sampling_params import SamplingParams
from eformer.escale import PartitionAxis, PartitionManager
from fake_model import VOCAB, fake_kv, next_token  # noqa: F401  (VOCAB, next_token: the tests read them here)
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from canary_jax.adapters.block_tables import from_block_tables
from canary_jax.adapters.layouts import sources_for_fused_kv
from canary_jax.contract.decode import ViolationRecord, decode_violations
from canary_jax.runtime import CanaryState, ExpectedInputs, RealKvHashMode, canary_head, canary_plan, canary_tail
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.state import CanaryStepConfig

for _name in ("easydel", "eformer"):
    logging.getLogger(_name).setLevel(logging.WARNING)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ServeConfig:
    """One serving run: eSurge's scheduler and cache sizes and the canary's mode."""

    page_size: int = 4
    num_pages: int = 40
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 32
    max_model_len: int = 96
    layers: int = 2
    heads: int = 2
    head_dim: int = 128
    real_kv_hash_mode: str = "ALL"
    seed: int = 0


def workload(seed: int) -> list[tuple[int, str, list[int], int]]:
    """``(arrival_step, rid, prompt, max_tokens)``: two shared system prefixes (page-aligned 20 and unaligned 13
    tokens, for eSurge's prefix cache), long prompts (chunked at the 32-token budget), an exact repeat of r00."""
    return fake_model.workload(seed, prefix_tokens=(20, 13))


class Runner:
    """Stands where ``eSurgeRunner`` stands: the attributes its ``_update_states`` reads, nothing else."""

    def __init__(self, cfg: ServeConfig, metadata: rp.RaggedPagesCacheConfig):
        self.metadata = metadata
        self.max_model_len = cfg.max_model_len
        self.requests: dict = {}
        self.sequence_buffer = SequenceBuffer(
            max_num_reqs=cfg.max_num_seqs,
            max_model_len=cfg.max_model_len,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            vocab_size=VOCAB,
            page_sizes=[cfg.page_size],
        )
        self.executor_manager = SimpleNamespace(clear_recurrent_slots=lambda rows: None)  # no recurrent layers

    update_states = eSurgeRunner._update_states


class Server:
    """eSurge's scheduler, page manager, sequence buffer, metadata preparer and KV cache, with the canary on."""

    def __init__(self, cfg: ServeConfig, *, fault: Callable[[Server, Any], Any] | None = None):
        self.cfg, self.fault = cfg, fault
        ps = cfg.page_size
        self.mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1, 1), ("dp", "fsdp", "ep", "tp", "sp"))
        dt = jnp.bfloat16
        self.cache_config = rp.RaggedPagesCacheConfig(  # as infra/mixins/generation.py builds it, version v2
            num_hidden_layers=cfg.layers,
            max_model_length=cfg.max_model_len,
            num_kv_heads=cfg.heads,
            k_headdim=cfg.head_dim,
            v_headdim=cfg.head_dim,
            page_size=ps,
            num_pages=cfg.num_pages,
            max_num_pages_per_req=rp.cdiv(cfg.max_model_len, ps),
            num_slices_per_kv_cache_update_page=rp.get_num_slices_per_kv_cache_update_page(
                rp.get_page_size_bytes(page_size=ps, num_kv_heads=cfg.heads, head_size=cfg.head_dim, kv_cache_dtype=dt)
            ),
            version="v2",
            _kvdtype_str=rp._dtype_to_string(dt),
        )
        with self.mesh:
            self.cache = rp.RaggedPagesCache.init_cache(
                mesh=self.mesh, config=self.cache_config, partition_manager=PartitionManager(PartitionAxis())
            )
        spec = FullAttentionSpec(page_size=ps, num_kv_heads=cfg.heads, head_size=cfg.head_dim, dtype=dt, use_mla=False)
        self.sched = Scheduler(
            Config(
                scheduler_config=SchedulerConfig(
                    max_num_seqs=cfg.max_num_seqs,
                    max_num_batched_tokens=cfg.max_num_batched_tokens,
                    max_model_len=cfg.max_model_len,
                    async_scheduling=False,
                    chunked_prefill_enabled=True,
                ),
                cache_config=CacheConfig(num_pages=cfg.num_pages, page_size=ps, enable_prefix_caching=True),
            ),
            CacheGroupsConfig(num_pages=cfg.num_pages, kv_cache_groups=[CacheGroupSpec(kv_cache_spec=spec)]),
        )
        self.runner = Runner(cfg, self.cache_config)
        self.preparer = BatchMetadataPreparer(
            metadata=self.cache_config,
            empty_sharding=NamedSharding(self.mesh, PartitionSpec()),
            max_num_tokens=cfg.max_num_batched_tokens,
            max_num_reqs=cfg.max_num_seqs,
            max_model_len=cfg.max_model_len,
            min_input_pad=cfg.max_num_seqs,
        )
        self.input_ids_buf = jnp.zeros((cfg.max_num_batched_tokens,), jnp.int32)
        self.position_ids_buf = jnp.zeros((cfg.max_num_batched_tokens,), jnp.int32)
        # the canary: one slot per KV slot (page * page_size + offset), page 0 is eSurge's null page
        self.config = CanaryStepConfig(
            verify_capacity=cfg.max_num_seqs * cfg.max_model_len,
            write_req_capacity=cfg.max_num_seqs + 1,
            real_kv_hash_mode=RealKvHashMode.from_name(cfg.real_kv_hash_mode),
            enable_write_input_assert=True,
            enable_verify_token_assert=True,
        )
        groups = [CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=cfg.num_pages * ps, has_v_half=False)]
        self.state = CanaryState.create(groups, ring_capacity=256)
        self.it, self.seen, self.forwards = 0, 0, []
        self.prefix_hits = self.chunked = self.preempted = self.finished = self.reused_pages = 0
        self.written_pages: set[int] = set()
        self.violations: list[tuple[int, ViolationRecord]] = []
        self.outputs: dict[str, list[int]] = {}
        self.workload = workload(cfg.seed)

    # ---------------------------------------------------------------------------------------- one forward
    def forward(self, so) -> ModelRunnerOutput:
        """What ``eSurgeRunner._execute_model_impl`` does for one step, with a fake model and the canary."""
        cfg, sb = self.cfg, self.runner.sequence_buffer
        self.runner.update_states(so)
        if self.fault is not None:
            self.fault(self, None)
        n = sb.num_reqs
        req_ids = [sb.req_ids[r] for r in range(n)]
        scheduled = np.zeros(cfg.max_num_seqs, np.int32)
        for r, rid in enumerate(req_ids):
            scheduled[r] = so.num_scheduled_tokens.get(rid, 0)
        pt = sb.page_table[0].get_cpu_tensor()
        md, self.input_ids_buf, self.position_ids_buf, _, _ = self.preparer.prepare_batch_metadata(
            num_tokens_static=cfg.max_num_batched_tokens,
            scheduled_full_cpu=scheduled,
            active_mask_full_cpu=scheduled > 0,
            input_ids_buf=self.input_ids_buf,
            position_ids_buf=self.position_ids_buf,
            token_ids_cpu=sb.token_ids,
            num_computed_tokens_cpu=sb.num_computed_tokens,
            temperature_cpu=sb.temperature,
            top_p_cpu=sb.top_p,
            top_k_cpu=sb.top_k,
            min_p_cpu=sb.min_p,
            frequency_penalties_cpu=sb.frequency_penalties,
            presence_penalties_cpu=sb.presence_penalties,
            repetition_penalties_cpu=sb.repetition_penalties,
            page_table_cpu=pt,
            padded_num_reqs_in=cfg.max_num_seqs,
        )
        rows = cfg.max_num_seqs
        cm = rp.RaggedPagesMetadata(  # as model_executor._backbone_step builds it
            pages_tables=md.pages_tables,
            context_lens=md.seq_lens[:rows],
            query_start_loc=md.query_start_loc[: rows + 1],
            num_seqs=jnp.array([n], dtype=jnp.int32),
            num_slices_per_kv_cache_update_page=self.cache_config.num_slices_per_kv_cache_update_page,
            page_size=cfg.page_size,
            request_distribution=None,
            slot_mapping=md.slot_mapping,
            num_kv_update_slices=md.num_kv_update_slices,
            version="v2",
        )
        # the oracle: each request's own tokens (EngineRequest.all_token_ids), per token and per row
        total = int(scheduled.sum())
        t = cfg.max_num_batched_tokens
        tokens, positions = np.zeros(t, np.int32), np.zeros(t, np.int32)
        exp_rows = np.zeros((rows, cfg.max_model_len), np.int32)
        valid = np.zeros(rows, np.int32)
        off = 0
        for r, rid in enumerate(req_ids):
            req = self.sched.requests[rid]
            nct, q = int(sb.num_computed_tokens[r]), int(scheduled[r])
            full = list(req.all_token_ids)[: nct + q]
            tokens[off : off + q], positions[off : off + q] = full[nct:], np.arange(nct, nct + q)
            exp_rows[r, : nct + q], valid[r] = full, nct + q
            off += q
        assert off == total
        fields = dict(
            input_ids=md.input_ids_buf,
            positions=md.position_ids_buf,
            query_start_loc=md.query_start_loc[: rows + 1],
            seq_lens=md.seq_lens[:rows],
            block_table=md.pages_tables,
            num_reqs=n,
        )
        if self.fault is not None:
            fields = self.fault(self, fields)
        batch = from_block_tables(
            **fields,
            block_size=cfg.page_size,
            null_block=0,
            expected_inputs=ExpectedInputs(tokens=tokens, positions=positions),
            expected_tokens=exp_rows,
            expected_tokens_valid_lens=valid,
        )
        plans = canary_plan(self.state, batch, config=self.config)
        self.state, plans = canary_head(self.state, batch, config=self.config, plans=plans)
        with self.mesh:
            for layer, view in enumerate(self.cache.views):
                k, v = fake_kv(layer, md.input_ids_buf, md.position_ids_buf, cfg.heads, cfg.head_dim)
                self.cache.views[layer] = view.concatenate_to_cache(k[None], v[None], cm)  # [1, T, H, D]
        sources = ((sources_for_fused_kv(self.cache.views[0].kv_pages, num_kv_heads=cfg.heads, half="k"), ()),)
        self.state, _ = canary_tail(self.state, plans, batch, config=self.config, real_kv_sources=sources)
        records = decode_violations(self.state.log, start=self.seen)
        self.seen += len(records)
        self.violations += [(self.it, rec) for rec in records]
        self.forwards.append((self.it, n, total))
        sm = np.asarray(md.slot_mapping)  # (cache start, new start, length) per slice; length 0 is padding
        new = {int(x) // cfg.page_size for x, ln in zip(sm[0], sm[2], strict=True) if ln > 0}
        self.reused_pages += len(new & self.written_pages - self.pages_of_running(req_ids, sb))
        self.written_pages |= new
        # the sync runner's sampling and token write-back (_finalize_sync_runner_state)
        ids, pos = np.asarray(md.input_ids_buf), np.asarray(md.position_ids_buf)
        qsl = np.asarray(md.query_start_loc)
        sampled = []
        for r, rid in enumerate(req_ids):
            req, st = self.sched.requests[rid], self.runner.requests[rid]
            nct, q = int(sb.num_computed_tokens[r]), int(scheduled[r])
            self.prefix_hits += int(nct > 0 and nct == req.num_cached_tokens and q > 1)
            if nct + q < req.num_tokens:  # a prefill chunk: nothing sampled
                self.chunked += int(q > 0)
                sampled.append([])
                continue
            last = int(qsl[r + 1]) - 1
            tid = next_token(int(ids[last]), int(pos[last]))
            if nct + q < cfg.max_model_len:
                sb.token_ids[r, nct + q] = tid
            st.output_token_ids.append(tid)
            sampled.append([tid])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            req_id_to_row_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
            spec_token_ids=None,
            logprobs=None,
            prompt_logprobs_dict={rid: None for rid in req_ids},
        )

    def pages_of_running(self, req_ids, sb) -> set[int]:
        """Pages the rows wrote before this step (their page-table entries below the computed tokens)."""
        pt, ps = sb.page_table[0].get_cpu_tensor(), self.cfg.page_size
        return {int(pt[r, j]) for r in range(len(req_ids)) for j in range(-(-int(sb.num_computed_tokens[r]) // ps))}

    # ---------------------------------------------------------------------------------------- the loop
    def run(self, *, until: int | None = None) -> Server:
        """EngineCore's step (``schedule`` -> runner -> ``update_from_output``) until the workload drains."""
        sched = self.sched
        last_arrival = max(w[0] for w in self.workload)
        while True:
            if (self.it > last_arrival and not sched.get_num_unfinished_requests()) or (
                until is not None and self.it >= until
            ):
                break
            if self.it > last_arrival + 400:
                raise RuntimeError("eSurge scheduler did not drain the workload")
            for _, rid, prompt, mt in (w for w in self.workload if w[0] == self.it):
                sp = SamplingParams(max_tokens=mt, temperature=0.0)
                sched.add_request(EngineRequest(rid, list(prompt), sp, eos_token_id=None))
            so = sched.schedule()
            self.preempted += len(so.preempted_req_ids)
            if so.total_num_scheduled_tokens > 0:
                out = self.forward(so)
                for eco in sched.update_from_output(so, out).values():
                    for o in eco.outputs:
                        self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
                        self.finished += int(o.finish_reason is not None)
            self.it += 1
        return self
