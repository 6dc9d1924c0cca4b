"""The fault campaign: a clean phase plus one fresh serving episode per (fault kind, trial).

Each episode serves the same workload from an empty pool with a fresh canary. From step ``inject_at`` on,
the fault tries to act every step until its preconditions hold (e.g. an orphan prefix needs a finished
request); the episode then runs until the canary reports a violation (plus one step, to collect follow-on
fail reasons) or until ``detect_window`` steps have passed. A violation before the injection is a false
positive. The clean phase serves the whole workload with no fault; every violation there is a false
positive. Jitted functions are shared by all episodes (fixed shapes), so only the first step compiles.
The bookkeeping (injection, detection, latency, fail reasons, false positives) is the public
:class:`canary_jax.tools.faults.FaultCampaign`; :func:`canary_jax.cli.demo.summary.summarize` turns the
:class:`CampaignResult` into the report.

``inject_at`` is ``inject_after`` plus a per-trial offset in ``[0, 8)``, capped at the last step where the
fault can still act and be seen before the workload ends. Those steps come from a scheduler-only dry run of
the workload (no model, no canary), which also refuses up front (``ConfigError``) a workload
too short for a fault kind. A kind the model cannot host at all (``kv_flip_hi`` with 16-byte K rows) runs
no episodes and is reported as not applicable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from canary_jax.cli.demo import canary_ops, workload
from canary_jax.cli.demo.engine import ConfigError, Engine, EngineConfig
from canary_jax.cli.demo.fault_base import Fault, WorkloadTrace
from canary_jax.cli.demo.faults import FAULT_KINDS
from canary_jax.cli.demo.model import PAD_TOKEN, ModelConfig, init_params
from canary_jax.cli.demo.scheduler import Request, Scheduler
from canary_jax.contract.decode import format_violation
from canary_jax.runtime import dump as dump_lib
from canary_jax.tools import faults as faults_lib

# jax.random.PRNGKey keeps 32 bits of a seed with x64 off (2**32 would silently equal seed 0).
MAX_SEED = 2**32 - 1
INJECT_SPREAD = 8  # per-trial offsets of the injection step: inject_after + [0, INJECT_SPREAD)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CampaignConfig:
    engine: EngineConfig
    model: ModelConfig
    num_requests: int = 24
    max_new_tokens: int = 16
    trials: int = 2
    inject_after: int = 6  # earliest injection step (plus a per-trial offset)
    detect_window: int = 24  # steps after injection before a fault counts as missed
    seed: int = 0
    prompt_path: str | None = None

    def __post_init__(self) -> None:
        for name, lo in (
            ("num_requests", 1),
            ("max_new_tokens", 1),
            ("trials", 1),
            ("inject_after", 0),
            ("detect_window", 1),
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo:
                raise ConfigError(f"{name} must be an integer >= {lo}, got {v!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"seed must be an integer in [0, {MAX_SEED}], got {self.seed!r}")


@dataclasses.dataclass
class TrialResult:
    kind: str
    trial: int
    injected: bool = False
    inject_step: int | None = None
    detected: bool = False
    detect_step: int | None = None
    steps_to_detect: int | None = None
    reasons: dict = dataclasses.field(default_factory=dict)  # "TAG:reason" -> rows
    violations: int = 0
    false_positives: int = 0
    details: dict = dataclasses.field(default_factory=dict)
    steps: int = 0
    first_violation: str = ""  # one-line summary
    first_violation_text: str = ""  # SGLang's full violation report text
    health_errors: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class PhaseStats:
    """The clean phase's timing, per step after the first (which compiles): ``step_s`` the served step (canary
    on), ``model_s`` the same step without the canary, ``canary_s`` their difference (see
    :meth:`canary_jax.cli.demo.engine.Engine.step`)."""

    steps: int = 0
    one_program: bool = True  # False: a canary runtime with separate HEAD / TAIL launches (canary_s = HEAD + TAIL)
    step_s: list = dataclasses.field(default_factory=list)
    model_s: list = dataclasses.field(default_factory=list)
    canary_s: list = dataclasses.field(default_factory=list)
    sweep_s: list = dataclasses.field(default_factory=list)
    sweep_entries: list = dataclasses.field(default_factory=list)
    tokens: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class CampaignResult:
    config: CampaignConfig
    backend: str
    device: str
    clean_false_positives: int
    clean_reasons: dict
    clean_health_errors: list
    clean: PhaseStats
    trials: list  # list[TrialResult]
    total_steps: int
    scheduler_stats: dict
    kinds: list  # list[Fault]
    not_applicable: dict = dataclasses.field(default_factory=dict)  # kind -> why it ran no episodes


def dry_run(cfg: CampaignConfig, kinds: list[Fault], requests=None) -> WorkloadTrace:
    """Schedules the workload with no model and no canary and records, per step, which kinds could act.

    Sampled tokens are replaced by PAD (never part of a prompt), so the schedule (which depends on lengths and
    prompt prefixes only) is the one a fault-free episode runs.
    """
    if requests is None:
        requests = workload.build_requests(
            workload.load_prompts(cfg.prompt_path),
            num_requests=cfg.num_requests,
            max_new_tokens=cfg.max_new_tokens,
            seed=cfg.seed,
        )
    reqs = [Request(rid=r.rid, prompt=list(r.prompt), max_new_tokens=r.max_new_tokens) for r in requests]
    sched = Scheduler(cfg.engine, reqs)
    ready = {f.kind: [] for f in kinds}
    allocs, sweeps = [], []
    step = 0
    pad = np.full((cfg.engine.max_running,), PAD_TOKEN, np.int32)
    while True:
        before = sched.stats["pages_allocated"]
        batch = sched.schedule()
        if batch is None:
            break
        if sched.stats["pages_allocated"] > before:
            allocs.append(step)
        for f in kinds:
            if f.ready(sched, batch):
                ready[f.kind].append(step)
        sched.complete(batch, pad)
        if cfg.engine.sweep_interval > 0 and (step + 1) % cfg.engine.sweep_interval == 0:
            sweeps.append(step)
        step += 1
    return WorkloadTrace(
        num_steps=step,
        ready={k: tuple(v) for k, v in ready.items()},
        alloc_steps=tuple(allocs),
        sweep_steps=tuple(sweeps),
    )


class Campaign:
    """Runs the clean phase and the fault episodes; ``on_step(label, step)`` feeds a progress bar."""

    def __init__(
        self,
        cfg: CampaignConfig,
        kinds: list[Fault],
        *,
        on_step: Callable[[str, int], None] | None = None,
        on_episode: Callable[[str], None] | None = None,
        dump_path: str | None = None,
    ):
        self.cfg = cfg
        self.kinds = kinds
        self.on_step = on_step or (lambda label, step: None)
        self.on_episode = on_episode or (lambda label: None)
        self.prompts = workload.load_prompts(cfg.prompt_path)
        probe = workload.build_requests(
            self.prompts, num_requests=cfg.num_requests, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed
        )
        cfg.engine.check_workload([len(r.prompt) for r in probe], cfg.max_new_tokens)
        self.not_applicable = {f.kind: f.not_applicable(cfg.model) for f in kinds if f.not_applicable(cfg.model)}
        self.trace = dry_run(cfg, kinds, probe)
        self.latest_inject = self._latest_inject_steps()
        self.params = init_params(cfg.model)
        self.dump_path = dump_path
        self.dumped: str | None = None
        self.dump_error: str | None = None  # why --dump could not be written (the CLI reports it, exit 2)
        self.last_engine: Engine | None = None
        self.tracker = faults_lib.FaultCampaign()

    def _latest_inject_steps(self) -> dict[str, int]:
        """Per kind, the last step at which it can act and still be seen; refuses a too-short workload."""
        out, short = {}, []
        for f in self.kinds:
            if f.kind in self.not_applicable:
                continue
            must_see = f.expected(self.cfg.engine).detect
            ok = [s for s in self.trace.ready[f.kind] if not must_see or f.detectable_after(self.trace, s)]
            if ok:
                out[f.kind] = max(ok)
            else:
                short.append(f)
        if short:
            raise ConfigError(
                f"the workload is too short for {', '.join(f.kind for f in short)}: in its {self.trace.num_steps} "
                "forward steps "
                + "; ".join(f"{f.kind} never finds {f.needs}" for f in short)
                + "; raise --requests or --max-new-tokens, or leave these kinds out of --inject"
            )
        return out

    def inject_step(self, fault: Fault, rng: np.random.Generator) -> int:
        """The first step a trial tries to inject at (draws the per-trial offset from ``rng``)."""
        return min(self.cfg.inject_after + int(rng.integers(0, INJECT_SPREAD)), self.latest_inject[fault.kind])

    def _engine(self) -> Engine:
        reqs = workload.build_requests(
            self.prompts, num_requests=self.cfg.num_requests, max_new_tokens=self.cfg.max_new_tokens, seed=self.cfg.seed
        )
        eng = Engine(self.cfg.engine, self.cfg.model, reqs, params=self.params, sample_seed=self.cfg.seed)
        self.last_engine = eng
        return eng

    def run_clean(self) -> tuple[int, dict, PhaseStats, dict]:
        self.on_episode("clean")
        eng = self._engine()
        stats = PhaseStats(one_program=eng.one_program)
        sweeps = 0
        while True:
            res = eng.step(timed=True)  # the model alone, then the served step: the canary's share is the difference
            if res is None:
                break
            stats.steps += 1
            # The first step (and the first sweep pass) compile; keep them out of the timing.
            if stats.steps > 1:
                stats.step_s.append(res.step_s)
                stats.model_s.append(res.model_s)
                stats.canary_s.append(res.canary_s)
                stats.tokens.append(res.num_tokens)
            if res.sweep_s:
                sweeps += 1
                if sweeps > 1:
                    stats.sweep_s.append(res.sweep_s)
                    stats.sweep_entries.append(res.swept)
            self.tracker.observe(res.new_violations, step=res.step)  # no episode open: false positives
            self.on_step("clean", res.step)
        fps = max(self.tracker.false_positives, eng.canary.log.num_violations())
        self.clean_health_errors = list(eng.health_errors)
        return fps, dict(self.tracker.false_positive_reasons), stats, dict(eng.scheduler.stats)

    def run_trial(self, fault: Fault, trial: int) -> TrialResult:
        label = f"{fault.kind}#{trial}"
        self.on_episode(label)
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, trial, FAULT_KINDS.index(fault.kind)])
        inject_at = self.inject_step(fault, rng)
        eng = self._engine()
        window = max(cfg.detect_window, cfg.engine.sweep_interval + 1)  # a sweep must get its chance
        out = TrialResult(kind=fault.kind, trial=trial)
        ep = self.tracker.begin(fault.kind, label=label)

        def hook(engine, batch):
            if ep.injected or engine.step_index < inject_at:
                return
            info = fault.try_inject(engine, batch, rng, trial)
            if info is not None:
                self.tracker.injected(step=engine.step_index, **info)

        try:
            while True:
                res = eng.step(hooks=(hook,))
                if res is None:
                    break
                out.steps += 1
                self.on_step(label, res.step)
                was_detected = ep.detected
                self.tracker.observe(res.new_violations, step=res.step)
                if ep.detected and not was_detected:
                    r = ep.first_violation
                    out.first_violation = f"{r.tag} {'+'.join(r.reasons)} slot={r.slot_idx} position={r.position}"
                    n = eng.canary.log.num_violations()
                    out.first_violation_text = format_violation(
                        r, total=n, ring_overflow=n > eng.canary.log.ring_capacity, step_when_pumped=res.step
                    )
                if ep.detected and res.step >= ep.detect_step + 1:
                    break
                if ep.injected and res.step - ep.inject_step >= window:
                    break
        finally:
            self.tracker.end()
        for name in (
            "injected",
            "inject_step",
            "detected",
            "detect_step",
            "steps_to_detect",
            "violations",
            "false_positives",
            "details",
        ):
            setattr(out, name, getattr(ep, name))
        out.reasons = dict(ep.reasons)
        out.health_errors = list(eng.health_errors)
        if self.dump_path and out.detected and self.dumped is None and self.dump_error is None:
            self._dump(eng, label)
        return out

    def _dump(self, eng: Engine, label: str) -> None:
        """Saves the episode's canary state, layer 0 of the pools it fingerprints and the live requests
        (:func:`canary_jax.runtime.dump.save_dump`; ``canary-jax verify-dump`` reads it)."""
        running = eng.scheduler.running
        rt = eng.canary
        try:
            dump_lib.save_dump(
                self.dump_path,
                rt.state,
                real_kv_sources=canary_ops.pool_sources(
                    eng.k_pool, eng.v_pool, page_size=rt.page_size, kv_bytes=rt.kv_bytes, config=rt.config
                ),
                real_kv_hash_mode=rt.config.real_kv_hash_mode,
                req_to_token=eng.scheduler.req_to_token,
                req_pool_indices=np.array([r.row for r in running], np.int64),
                seq_lens=np.array([r.kv_len for r in running], np.int64),
                step=eng.step_index,
            )
        except OSError as e:  # disk full, /dev/full, permissions: reported by the CLI after the run
            self.dump_error = e.strerror or str(e)
            return
        self.dumped = label

    def run(self) -> CampaignResult:
        fps, clean_reasons, clean, sched_stats = self.run_clean()
        total = clean.steps
        trials = []
        for fault in self.kinds:
            if fault.kind in self.not_applicable:
                continue
            for t in range(self.cfg.trials):
                tr = self.run_trial(fault, t)
                total += tr.steps
                trials.append(tr)
        fps += sum(t.false_positives for t in trials)
        return CampaignResult(
            config=self.cfg,
            backend=self.last_engine.canary.backend if self.last_engine else "?",
            device=f"{jax.default_backend()} ({jax.devices()[0].device_kind})",
            clean_false_positives=fps,
            clean_reasons=clean_reasons,
            clean_health_errors=self.clean_health_errors,
            clean=clean,
            trials=trials,
            total_steps=total,
            scheduler_stats=sched_stats,
            kinds=self.kinds,
            not_applicable=dict(self.not_applicable),
        )
