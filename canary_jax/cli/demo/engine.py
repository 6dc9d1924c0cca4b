"""A tiny paged-KV serving engine with the KV canary on every forward.

Pieces (all host-side Python except the jitted serving step and the sweep):

* :class:`EngineConfig`: pool, batch and canary sizes, validated against the workload up front (defined in
  :mod:`canary_jax.cli.demo.config` with :class:`ConfigError`, re-exported here).
* :class:`~canary_jax.cli.demo.scheduler.Scheduler` (in :mod:`canary_jax.cli.demo.scheduler`): admission,
  chunked prefill + decode batching, ``req_to_token`` table, prefix caching and page lifetime.
* :class:`Engine`: owns the model weights, the bf16 K/V pools, the canary buffers and violation log, and runs
  one step: schedule -> one jitted program (plan -> HEAD verify+write -> model forward, which writes KV ->
  TAIL verify+write with the real-KV fingerprint of layer 0's K pool -> sample) -> every ``sweep_interval`` steps
  a SWEEP verify of every cached prefix. Fault hooks run between scheduling and the step's program.

Every array handed to jit has a fixed capacity (tokens, batch rows, verify entries, sweep entries), so each
jitted program compiles once per run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from canary_jax.cli.demo import canary_ops, model
from canary_jax.cli.demo.config import ConfigError, EngineConfig  # noqa: F401  (ConfigError: re-exported)
from canary_jax.cli.demo.scheduler import Batch, Request, Scheduler
from canary_jax.contract.decode import ViolationRecord, decode_violations
from canary_jax.runtime.report import HealthChecker
from canary_jax.runtime.state import active_tags


@dataclasses.dataclass
class StepResult:
    """One forward's outcome. Times are wall seconds: ``step_s`` the served forward (plan, HEAD, model, TAIL);
    ``model_s`` the model alone and ``canary_s`` the canary's share (None for a step run without ``timed``)."""

    step: int
    num_tokens: int
    num_rows: int
    step_s: float
    model_s: float | None
    canary_s: float | None
    sweep_s: float
    swept: int
    new_violations: list  # list[ViolationRecord]


class Engine:
    """Model + pools + canary, stepped by :meth:`step`."""

    # The model's own program on the split path (a runtime without one-program ``forward``): a sharded engine
    # swaps in one that keeps its pools' sharding.
    model_forward = staticmethod(model.forward)

    def __init__(
        self,
        cfg: EngineConfig,
        model_cfg: model.ModelConfig,
        requests: Sequence[Request],
        *,
        params: dict | None = None,
        sample_seed: int = 0,
    ):
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.params = params if params is not None else model.init_params(model_cfg)
        self.k_pool, self.v_pool = model.allocate_pools(model_cfg, num_pages=cfg.num_pages, page_size=cfg.page_size)
        self.scheduler = Scheduler(cfg, requests)
        self.canary = canary_ops.CanaryRuntime(
            kv_bytes_per_token=model_cfg.kv_bytes_per_token, **canary_ops.runtime_args(cfg)
        )
        self.key = jax.random.PRNGKey(sample_seed)
        self.step_index = 0
        self.violations_seen = 0
        # SGLang's kernel-run-counter health check, more often than its every-100-steps default: a canary
        # path that silently stops launching must not look like a clean run.
        every = max(16, cfg.sweep_interval)
        self.health = HealthChecker(
            active_tags(self.canary.state, sweep=cfg.sweep_interval > 0, enable_v_half=cfg.enable_v_half),
            sweep_interval=cfg.sweep_interval,
            enable_v_half=cfg.enable_v_half,
            every_n_steps=every,
            warmup_steps=every,
        )
        self.health_errors: list[str] = []

    # --- the per-forward flow ---------------------------------------------------------------------------------
    def step(self, hooks: Sequence[Callable[[Engine, Batch], None]] = (), *, timed: bool = False) -> StepResult | None:
        """One forward; returns None when there is nothing left to run.

        The forward is one jitted program (:meth:`CanaryRuntime.forward`: plan, HEAD, the model, TAIL). With
        ``timed``, the same step without the canary (:meth:`CanaryRuntime.model_only`) runs first on the same
        inputs, so ``model_s`` is the model alone and ``canary_s`` the canary's share of the served step (the two
        programs' difference). The model-only run writes the same KV rows that the served step then writes again
        (and TAIL fingerprints), so the pools end as without it.
        """
        sched = self.scheduler
        batch = sched.schedule()
        if batch is None:
            return None
        for hook in hooks:
            hook(self, batch)
        if not hasattr(self.canary, "forward"):  # a runtime with separate HEAD / TAIL launches
            return self._step_split(batch)
        model_in = self.canary.model_inputs(batch, sched.req_to_token, self.key, self.step_index)
        model_s = None
        if timed:
            t0 = time.perf_counter()
            self.k_pool, self.v_pool, _ = self.canary.model_only(
                self.params, self.k_pool, self.v_pool, model_in, model_cfg=self.model_cfg
            )
            jax.block_until_ready((self.k_pool, self.v_pool))
            model_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.k_pool, self.v_pool, next_tokens = self.canary.forward(
            batch,
            sched.req_to_token,
            sched.expected_tokens,
            self.params,
            self.k_pool,
            self.v_pool,
            model_in,
            model_cfg=self.model_cfg,
        )
        next_tokens = np.asarray(next_tokens)
        self.canary.block()
        step_s = time.perf_counter() - t1
        return self._finish_step(
            batch, next_tokens, step_s=step_s, model_s=model_s, canary_s=None if model_s is None else step_s - model_s
        )

    def _step_split(self, batch: Batch) -> StepResult:
        """The forward as separate launches (HEAD, the model's own program, TAIL), for a canary runtime that has
        no one-program :meth:`forward`; ``canary_s`` is then HEAD + TAIL's wall time."""
        sched = self.scheduler
        t0 = time.perf_counter()
        self.canary.head(batch, sched.req_to_token, sched.expected_tokens)
        self.canary.block()
        t1 = time.perf_counter()
        self.k_pool, self.v_pool, next_tokens = self.model_forward(
            self.params,
            self.k_pool,
            self.v_pool,
            batch.input_ids,
            batch.positions,
            batch.out_cache_loc,
            batch.token_rows,
            sched.req_to_token,
            batch.sample_index,
            jax.random.fold_in(self.key, self.step_index),
            cfg=self.model_cfg,
        )
        next_tokens = np.asarray(jax.block_until_ready(next_tokens))
        t2 = time.perf_counter()
        self.canary.tail(self.k_pool, self.v_pool)
        self.canary.block()
        t3 = time.perf_counter()
        return self._finish_step(batch, next_tokens, step_s=t3 - t0, model_s=t2 - t1, canary_s=(t1 - t0) + (t3 - t2))

    def _finish_step(self, batch: Batch, next_tokens: np.ndarray, *, step_s, model_s, canary_s) -> StepResult:
        """After the forward: the scheduler's bookkeeping, the sweep when due, the health check, the new
        violations."""
        cfg, sched = self.cfg, self.scheduler
        sched.complete(batch, next_tokens)
        swept, sweep_s = 0, 0.0
        if cfg.sweep_interval > 0 and (self.step_index + 1) % cfg.sweep_interval == 0:
            t4 = time.perf_counter()
            swept = self.canary.sweep(sched.tree, self.k_pool, self.v_pool)
            self.canary.block()
            sweep_s = time.perf_counter() - t4
        try:
            self.health.step(self.canary.log, step=self.step_index + 1)
        except RuntimeError as e:
            self.health_errors.append(str(e))
        new = self.poll_violations()
        res = StepResult(
            step=self.step_index,
            num_tokens=batch.num_tokens,
            num_rows=len(batch.rows),
            step_s=step_s,
            model_s=model_s,
            canary_s=canary_s,
            sweep_s=sweep_s,
            swept=swept,
            new_violations=new,
        )
        self.step_index += 1
        return res

    @property
    def one_program(self) -> bool:
        """Whether each forward runs as one jitted program (the canary runtime has :meth:`forward`)."""
        return hasattr(self.canary, "forward")

    def poll_violations(self) -> list[ViolationRecord]:
        """Violations recorded since the last poll (a device-to-host read of the write index, then the ring)."""
        log = self.canary.log
        n = log.num_violations()
        if n <= self.violations_seen:
            return []
        rows = decode_violations(log, start=self.violations_seen)  # rows past the ring's capacity are lost
        self.violations_seen = n
        return rows
