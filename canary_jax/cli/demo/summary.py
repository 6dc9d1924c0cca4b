"""The campaign's report as plain data: per fault kind, detection, latency and verdict; false positives;
timing of the clean phase. The same dict is printed by :mod:`canary_jax.cli.render` and written by ``--json``.
"""

from __future__ import annotations

import dataclasses
import statistics

from canary_jax.contract import constants
from canary_jax.tools.faults import kind_report


def _ms(xs) -> float | None:
    return round(1e3 * statistics.median(xs), 3) if xs else None


def _mean_ms(xs) -> float | None:
    return round(1e3 * statistics.fmean(xs), 3) if xs else None


def summarize(result) -> dict:
    """The report of a :class:`~canary_jax.cli.demo.campaign.CampaignResult` as plain data (also the
    ``--json`` payload): keys ``ok``, ``faults``, ``false_positives``, ``false_positive_reasons``,
    ``health_errors``, ``steps``, ``timing`` (milliseconds per step; ``timing["note"]`` says what is measured,
    ``timing["parts"]`` are the time table's rows), ``canary``, ``workload``, ``engine`` and ``model``."""
    ecfg = result.config.engine
    faults = []
    for fault in result.kinds:
        trs = [t for t in result.trials if t.kind == fault.kind]
        exp = fault.expected(ecfg)
        na = result.not_applicable.get(fault.kind, "")
        rep = kind_report(fault.kind, trs)  # injected, detected, latency, fail reasons (canary_jax.tools.faults)
        injected, detected, lat = rep.injected, rep.detected, list(rep.steps_to_detect)
        # status: a fixed vocabulary for tables and charts; verdict: the words shown to people.
        if na:
            status, verdict = "not_applicable", f"n/a: {na}"
        elif injected < len(trs):
            status = "not_injected"
            verdict = (
                f"NOT INJECTED in {len(trs) - injected} of {len(trs)} trials (the workload ended before the "
                "fault could act; serve more --requests)"
            )
        elif exp.detect:
            status = "ok" if detected == injected else "missed"
            verdict = "ok" if detected == injected else "MISSED"
        elif detected < injected:
            status, verdict = "expected_miss", f"expected miss: {exp.why_not}"
        else:
            status, verdict = "ok_anyway", "ok (detected anyway)"
        faults.append(
            dict(
                kind=fault.kind,
                summary=fault.summary,
                caught_by=fault.caught_by,
                trials=len(trs),
                injected=injected,
                detected=detected,
                applicable=not na,
                not_applicable_reason=na or None,
                expected_detect=exp.detect and not na,
                expected_miss_reason=(na or exp.why_not) or None,
                steps_to_detect=lat,
                mean_steps_to_detect=rep.mean_steps_to_detect,
                max_steps_to_detect=rep.max_steps_to_detect,
                fail_reasons=rep.fail_reasons,
                status=status,
                verdict=verdict,
                ok=status in ("ok", "expected_miss", "ok_anyway", "not_applicable"),
                episodes=[dataclasses.asdict(t) for t in trs],
            )
        )
    c = result.clean
    model_med, canary_med = _ms(c.model_s), _ms(c.canary_s)
    sweep_interval = result.config.engine.sweep_interval
    sweep_per_step = (statistics.fmean(c.sweep_s) / sweep_interval) if c.sweep_s and sweep_interval else 0.0
    cpu = (
        f"; on a CPU these are CPU figures of the {result.backend} kernels, not GPU figures"
        if result.device.startswith("cpu")
        else ""
    )
    if c.one_program:
        method = "one_program"
        note = (
            "wall-clock per forward step of the clean phase (first step and first sweep, which compile, left out). "
            "Each forward is one jitted program (plan, HEAD, the model's KV write and forward, TAIL); every step "
            "first runs the same jitted step with the canary off on the same inputs (the model alone), then with "
            "it on, each timed to block_until_ready. The canary's share is the per-step difference (on - off), "
            "so it counts what the canary adds to the one program, host-side batch conversion included; the "
            f"sweep is its own program, timed apart{cpu}"
        )
        parts = [
            ("served step, canary on (plan+HEAD+model+TAIL, 1 program)", _ms(c.step_s), _mean_ms(c.step_s)),
            ("same step, canary off (the model alone)", model_med, _mean_ms(c.model_s)),
            ("canary's share: on - off, per step", canary_med, _mean_ms(c.canary_s)),
        ]
    else:
        method = "separate_launches"
        note = (
            "wall-clock per forward step of the clean phase (first step and first sweep, which compile, left "
            "out), measured with block_until_ready around each part: the model's own program, and the canary's "
            f"HEAD (plan included) and TAIL launches{cpu}"
        )
        parts = [
            ("model forward (per step)", model_med, _mean_ms(c.model_s)),
            ("canary HEAD+TAIL incl. plan (per step)", canary_med, _mean_ms(c.canary_s)),
        ]
    timing = dict(
        device=result.device,
        backend=result.backend,
        method=method,
        note=note,
        clean_steps=c.steps,
        step_ms_per_step_median=_ms(c.step_s),
        step_ms_per_step_mean=_mean_ms(c.step_s),
        model_ms_per_step_median=model_med,
        model_ms_per_step_mean=_mean_ms(c.model_s),
        canary_ms_per_step_median=canary_med,
        canary_ms_per_step_mean=_mean_ms(c.canary_s),
        sweep_ms_per_pass_median=_ms(c.sweep_s),
        sweep_passes=len(c.sweep_s),
        sweep_ms_per_step_amortized=round(1e3 * sweep_per_step, 3),
        canary_overhead_pct=(
            round(100.0 * (statistics.fmean(c.canary_s) + sweep_per_step) / statistics.fmean(c.model_s), 1)
            if c.model_s
            else None
        ),
        tokens_per_step_mean=round(statistics.fmean(c.tokens), 2) if c.tokens else None,
        parts=[dict(part=p, median_ms=med, mean_ms=mean) for p, med, mean in parts],
    )
    health = list(result.clean_health_errors) + [e for t in result.trials for e in t.health_errors]
    ok = result.clean_false_positives == 0 and all(f["ok"] for f in faults) and not health
    mode = constants.RealKvHashMode(int(ecfg.real_kv_hash_mode)).name
    return dict(
        ok=ok,
        faults=faults,
        false_positives=result.clean_false_positives,
        false_positive_reasons=result.clean_reasons,
        health_errors=health,
        steps=result.total_steps,
        timing=timing,
        canary=dict(
            real_kv_hash_mode=mode,
            sweep_interval=ecfg.sweep_interval,
            token_oracle=ecfg.token_oracle,
            mha_v=ecfg.enable_v_half,
            tags=[
                constants.CanaryLaunchTag(t).name
                for t in sorted(
                    t
                    for t in constants.CanaryLaunchTag
                    if t.group == "FULL"
                    and (ecfg.sweep_interval > 0 or not t.is_sweep)
                    and (ecfg.enable_v_half or not t.is_v_half)
                )
            ],
        ),
        workload=dict(
            num_requests=result.config.num_requests,
            max_new_tokens=result.config.max_new_tokens,
            trials=result.config.trials,
            seed=result.config.seed,
            **result.scheduler_stats,
        ),
        engine=dict(
            page_size=ecfg.page_size,
            num_pages=ecfg.num_pages,
            max_running=ecfg.max_running,
            max_tokens_per_step=ecfg.max_tokens_per_step,
            chunk_size=ecfg.chunk_size,
            max_context=ecfg.max_context,
        ),
        model=dataclasses.asdict(result.config.model),
    )
