"""The profiles: an optimized HLO module's op index, the kernel events of a ``jax.profiler`` trace, and their
attribution to the step's parts (named scopes, nested jits, kernel names and their place in the timeline)."""

from __future__ import annotations

import glob
import os
import re
import shutil

import jax

_DERIVED_LINES = {"XLA Modules", "XLA Ops", "TensorFlow Ops", "TensorFlow Name Scope", "Steps", "Source code"}


def hlo_index(hlo_text: str) -> tuple[str, dict]:
    """``(module name, {instruction name: (opcode, op_name)})`` of an optimized HLO module's text."""
    module = ""
    out = {}
    for line in hlo_text.splitlines():
        if line.startswith("HloModule "):
            module = line.split()[1].rstrip(",")
            continue
        mt = re.match(r"\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$", line)
        if not mt:
            continue
        name, rest = mt.group(1), mt.group(2)
        op = re.search(r"(?:^|[\s)}\]])([a-z][a-z0-9\-]*)\(", rest)
        meta = re.search(r'op_name="([^"]*)"', rest)
        out[name] = (op.group(1) if op else "", meta.group(1) if meta else "")
    return module, out


def sanitize(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def part_of(op_name: str, kernel: str) -> str:
    """The step part an HLO op belongs to, from its op_name (named scopes, nested jits) or its kernel name."""
    s = op_name or ""
    low = kernel.lower()
    if "canary_sweep" in s:
        return "sweep_plan" if "build_plans" in s else "sweep_verify"
    if "canary_plan" in s:
        return "plan"
    for phase in ("head", "tail"):
        if f"canary_{phase}" in s:
            if "verify" in s:
                return f"{phase}_verify"
            if "write" in s:
                return f"{phase}_write"
            return f"{phase}_other"
    if "/model/" in s or s.endswith("/model"):
        return "model"
    if "build_plans" in s:
        return "plan"
    if "verify" in s:
        return "verify"
    if "write" in s:
        return "write"
    if low.startswith("canary_plan"):
        return "plan"  # the Pallas plan kernel (the sweep's plan too: attribute() tells it apart by its verify)
    if low.startswith("canary_"):
        return "canary_unattributed"
    if any(x in low for x in ("gemm", "xmma", "cutlass", "nvjet", "cudnn", "flash", "paged_attention", "sm90")):
        return "model"
    if low.startswith("memcpy") or low.startswith("memset"):
        return "memcpy"
    return "other"


def trace_events(logdir: str, module: str) -> tuple[list, dict]:
    """Kernel events ``(name, start ns, duration ns, hlo_op, tf_op)`` of the newest trace under ``logdir``, in
    start order (GPU streams; on the CPU the thunks of ``module``), and what was seen (planes, lines)."""
    files = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        return [], {"error": "no xplane file"}
    pd = jax.profiler.ProfileData.from_file(files[-1])
    planes = list(pd.planes)
    seen = {"planes": [p.name for p in planes]}
    events = []
    gpu = [p for p in planes if p.name.startswith("/device:GPU")]
    if gpu:
        lines_seen, stat_names = [], set()
        for p in gpu:
            lines = list(p.lines)
            lines_seen += [ln.name for ln in lines]
            stream = [ln for ln in lines if ln.name.startswith("Stream")]
            use = stream or [ln for ln in lines if ln.name not in _DERIVED_LINES]
            for ln in use:
                for e in ln.events:
                    st = dict(e.stats)
                    stat_names.update(st)
                    events.append((e.name, float(e.start_ns), float(e.duration_ns), st.get("hlo_op"), st.get("tf_op")))
        seen["gpu_lines"] = sorted(set(lines_seen))
        seen["stat_names"] = sorted(stat_names)
        n = max(1, len(events))
        seen["events_with_hlo_op"] = sum(1 for e in events if e[3]) / n
        seen["events_with_tf_op"] = sum(1 for e in events if e[4]) / n
    else:
        for p in planes:
            if not p.name.startswith("/host:CPU"):
                continue
            for ln in p.lines:
                for e in ln.events:
                    st = dict(e.stats)
                    if st.get("hlo_module") == module and st.get("hlo_op"):
                        events.append((e.name, float(e.start_ns), float(e.duration_ns), st.get("hlo_op")))
    events.sort(key=lambda e: e[1])
    return events, seen


_CANARY_KERNEL = re.compile(r"^(canary_[a-z_]+?)(?:__(\d+))?$")
# one kernel serves HEAD and TAIL (deduplicated by XLA)
_SHARED = ("canary_write_claim", "canary_write_won", "canary_write_long")


def _canary_phase(name: str, region: str | None) -> tuple[str, str] | None:
    """``(phase, kind)`` of a Pallas canary kernel without an op_name. XLA names identical kernels once and the
    others ``__1``, ``__2`` in program order, and the step's order is HEAD, TAIL, sweep: so index 0 is HEAD,
    1 TAIL, 2 the sweep; a kernel HEAD and TAIL share (``_SHARED``), and a TAIL kernel the sweep reuses (same
    shapes), take the phase of where they run in the timeline (``region``). Kinds: ``verify``, ``write``, and
    ``phase`` for ``canary_phase`` (a phase's verify and write in one kernel)."""
    mt = _CANARY_KERNEL.match(name)
    if not mt:
        return None
    base, idx = mt.group(1), int(mt.group(2) or 0)
    kind = "phase" if base == "canary_phase" else "verify" if "verify" in base else "write"
    if base in _SHARED or region == "sweep":
        phase = {"plan": "head", "model": "tail"}.get(region, region) or ("head" if idx == 0 else "tail")
    else:
        phase = ("head", "tail", "sweep")[min(idx, 2)]
    return phase, kind


def attribute(events: list, hlo: dict, steps: float, top: int = 25, cycle: int = 0) -> dict:
    """Kernel time per step by part, the top kernels, and how much had no op_name.

    A kernel's part comes from its HLO op_name (through the ``hlo_op`` stat or its sanitized kernel name); a
    Pallas canary kernel without one by :func:`_canary_phase`; a copy or other unattributed kernel that runs
    inside the canary's part of the timeline (after the plan, or after a canary kernel that follows the model)
    is charged to that part as ``<part>_copy`` / ``<part>_other``. When the sweep's plan has the per-forward
    plan's shapes, XLA gives both the same kernels (names): a verify kernel of index >= 1 that follows plan
    kernels with no model kernel between is then the sweep's, and so are those plan kernels.
    ``cycle`` > 0 keeps the non-model kernels of the last ``cycle`` steps' worth of events as ``timeline``.
    """
    by_sanitized = {sanitize(k): k for k in hlo}
    labels: list = []  # (name, ns, part) per kept event
    unattributed = 0.0
    region, plan_start = None, 0  # plan | head | model | tail | sweep; where the current plan region began
    for name, _, ns, hlo_op, *rest in events:
        key = hlo_op if hlo_op in hlo else by_sanitized.get(sanitize(name))
        opcode, op_name = hlo.get(key, ("", "")) if key else ("", "")
        op_name = op_name or (rest[0] if rest and isinstance(rest[0], str) else "")  # the trace's tf_op stat
        if opcode in ("while", "conditional", "call", "async-start", "async-done", "tuple", "parameter"):
            continue  # CPU control-flow thunks (their bodies are counted themselves)
        part = part_of(op_name, name)
        if not op_name:
            unattributed += ns
        if not op_name or part == "canary_unattributed":  # an op_name without the step's scopes names no part
            mt = _CANARY_KERNEL.match(name)
            if mt and region == "plan" and "verify" in name and int(mt.group(2) or 0) >= 1:
                for i in range(plan_start, len(labels)):  # the plan kernels since the TAIL were the sweep's
                    n_, ns_, p_ = labels[i]
                    if p_ == "plan" or p_.startswith("plan_"):
                        labels[i] = (n_, ns_, p_.replace("plan", "sweep_plan", 1) if p_ == "plan" else "sweep" + p_[4:])
                region = "sweep"
            cp = _canary_phase(name, region) if part == "canary_unattributed" else None
            if cp is not None:
                part = f"{cp[0]}_{cp[1]}"
            elif part in ("other", "memcpy") and region in ("plan", "head", "tail", "sweep"):
                part = f"{region}_{'copy' if part == 'memcpy' else 'other'}"
        if part == "plan":
            if region != "plan":
                plan_start = len(labels)
            region = "plan"
        elif part == "sweep_plan":
            region = "sweep"
        elif part == "model":
            region = "model"
        elif part.startswith(("head_", "tail_", "sweep_")) and not part.endswith(("_copy", "_other")):
            region = part.split("_")[0]
        labels.append((name, ns, part))
    parts: dict[str, float] = {}
    kernels: dict[tuple, list] = {}
    total = 0.0
    for name, ns, part in labels:
        total += ns
        parts[part] = parts.get(part, 0.0) + ns
        k = kernels.setdefault((name, part), [0.0, 0])
        k[0] += ns
        k[1] += 1
    per = 1e6 * steps  # ns -> ms per step
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    out = {
        "kernel_sum_ms": total / per,
        "parts_ms": {k: v / per for k, v in sorted(parts.items())},
        "no_op_name_frac": unattributed / total if total else None,
        "events": len(events),
        "launches_per_step": {p: sum(v[1] for (_, q), v in kernels.items() if q == p) / steps for p in parts},
        "top_kernels": [
            {"kernel": n[:120], "part": p, "ms_per_step": v[0] / per, "launches_per_step": v[1] / steps}
            for (n, p), v in rows[:top]
        ],
        "canary_kernels": [
            {"kernel": n[:120], "part": p, "ms_per_step": v[0] / per, "launches_per_step": v[1] / steps}
            for (n, p), v in rows
            if p not in ("model",)
        ][:80],
    }
    if cycle > 0 and steps > 0:
        tail = labels[-int(len(labels) * min(1.0, cycle / steps)) :]
        out["timeline"] = [[n[:60], p, round(ns / 1e3, 2)] for n, ns, p in tail if p != "model"]
    return out


def profile_launches(prog, carry, consts, logdir: str, n: int) -> dict:
    """Runs the compiled loop ``prog(carry, consts)`` (``n`` launches per call; ``carry`` donated) once under the
    profiler: ``{"kernel_sum_us": kernel time per launch, "kernels": the top 12 kernels, us and launches per
    launch}``."""
    module, index = hlo_index(prog.as_text())
    holder = [carry]

    def once():
        holder[0] = prog(holder[0], consts)
        return holder[0]

    _, prof = profile_call(once, logdir, module, index, n)
    return {
        "kernel_sum_us": 1e3 * prof.get("kernel_sum_ms", float("nan")),
        "kernels": [
            {"kernel": r["kernel"], "us": 1e3 * r["ms_per_step"], "launches": r["launches_per_step"]}
            for r in prof.get("top_kernels", [])[:12]
        ],
    }


def profile_call(fn, logdir: str, module: str, hlo: dict, steps: float, cycle: int = 0):
    """Runs ``fn()`` under the profiler; returns ``(result, attribution)``."""
    shutil.rmtree(logdir, ignore_errors=True)
    os.makedirs(logdir, exist_ok=True)
    jax.profiler.start_trace(logdir)
    try:
        out = jax.block_until_ready(fn())
    finally:
        jax.profiler.stop_trace()
    events, seen = trace_events(logdir, module)
    res = attribute(events, hlo, steps, cycle=cycle) if events else {}
    res["trace"] = seen
    return out, res
