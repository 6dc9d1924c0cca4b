"""The jitted programs: the timed step loop (plan, HEAD, the model, TAIL, a periodic sweep, inputs tied to the
carry by an ``optimization_barrier``), the empty donating program timed beside it, and each canary part (plan,
HEAD / TAIL verify and write, sweep) as its own program on the step's inputs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import canary_jax as cj
from benchmarks.serving_step.batch import canary_batch, canary_config, sources_of, step_ids
from benchmarks.serving_step.model import forward
from benchmarks.serving_step.shapes import HASH, bucket
from canary_jax.contract.constants import CanaryLaunchTag
from canary_jax.runtime.step import canary_head, canary_plan, canary_sweep, canary_tail
from canary_jax.runtime.sweep import build_sweep_plan_from_requests


def barrier(consts, carry):
    """Ties the loop-invariant inputs to a loop-carried value (an ``optimization_barrier``), so XLA cannot hoist
    work on them (the plan build, the weights' layout) out of the timed loop; the carry itself stays outside
    the barrier (it is loop-variant already, and its big buffers keep their aliasing)."""
    leaves, tree = jax.tree.flatten(carry)
    tie = min(range(len(leaves)), key=lambda i: leaves[i].size)  # the smallest carried array
    consts, leaves[tie] = jax.lax.optimization_barrier((consts, leaves[tie]))
    return consts, jax.tree.unflatten(tree, leaves)


def build_program(scn, mode, m, attn, args, sweep_interval):
    """The timed program: ``steps`` serving steps (and a sweep every ``sweep_interval``) in one jit, carry
    ``(kv, state, toks, summary)`` donated."""
    cfg = None if mode == "off" else canary_config(scn, mode, args.backend)
    interval = sweep_interval if sweep_interval > 0 else scn.steps
    cycles = scn.steps // interval
    ps, rb = args.page_size, args.read_bytes or 2 * m.kv_dim
    fwd = functools.partial(forward, m=m, kind=scn.kind, attn=attn, page_size=ps)

    def one_step(carry, consts):
        consts, carry = barrier(consts, carry)
        params, b = consts
        kv, state, toks, summ = carry
        ids = step_ids(scn, m, b, toks)
        if cfg is not None:
            cb = canary_batch(b, ids)
            with jax.named_scope("canary_plan"):
                plans = canary_plan(state, cb, config=cfg)
            with jax.named_scope("canary_head"):
                state, plans = canary_head(state, cb, config=cfg, plans=plans)
        with jax.named_scope("model"):
            kv, toks = fwd(params, kv, ids, b["positions"], b["loc"], b)
        if cfg is not None:
            with jax.named_scope("canary_tail"):
                state, s = canary_tail(state, plans, cb, config=cfg, real_kv_sources=sources_of(kv, m, ps, rb))
            summ = (s.verify_enable, s.verify_num_valid)
        return kv, state, toks, summ

    def cycle(carry, consts):
        carry = jax.lax.fori_loop(0, interval, lambda i, c: one_step(c, consts), carry)
        if cfg is not None and sweep_interval > 0:
            consts, carry = barrier(consts, carry)
            _, b = consts
            kv, state, toks, summ = carry
            with jax.named_scope("canary_sweep"):
                plan = build_sweep_plan_from_requests(
                    req_to_token=b["r2t"],
                    req_pool_indices=b["sweep_rpi"],
                    seq_lens=b["sweep_lens"],
                    verify_capacity=bucket(scn.sweep_entries),
                )
                state = canary_sweep(state, (plan,), config=cfg, real_kv_sources=sources_of(kv, m, ps, rb))
            carry = (kv, state, toks, summ)
        return carry

    def program(carry, consts):
        return jax.lax.fori_loop(0, cycles, lambda i, c: cycle(c, consts), carry)

    return jax.jit(program, donate_argnums=(0,))


def _empty(carry, consts):
    return carry


EMPTY = jax.jit(_empty, donate_argnums=(0,))


# --- the parts as their own programs --------------------------------------------------------------------------
def part_programs(scn, m, args, modes):
    """``{name: (fn(carry, consts) -> carry, mode)}``: each part of the step on the step's inputs."""
    ps, rb = args.page_size, args.read_bytes or 2 * m.kv_dim
    canary_modes = [x for x in modes if x != "off"]
    if not canary_modes:
        return {}
    head_mode = canary_modes[0]
    cfg = {x: canary_config(scn, x, args.backend) for x in canary_modes}
    backend = args.backend

    def ctx(buf, tag, log, srcs, mode):
        return cj.VerifyOrWriteContext(
            canary_buf=buf, kernel_kind=tag, log=log, real_kv_sources=srcs, real_kv_hash_mode=HASH[mode]
        )

    def plan_fn(carry, consts):
        consts, carry = barrier(consts, carry)
        state, b, toks = consts
        return canary_plan(state, canary_batch(b, step_ids(scn, m, b, toks)), config=cfg[head_mode])

    def verify_fn(tag, mode, with_src):
        def fn(log, consts):
            consts, log = barrier(consts, log)
            buf, plans, kv0 = consts
            srcs = sources_of(((kv0,), ()), m, ps, rb)[0][0] if with_src else ()
            vp = plans.per_group[0][0]
            return cj.verify(ctx(buf, tag, log, srcs, mode), vp, backend=backend).log

        return fn

    def write_fn(tag, mode, with_src):
        def fn(carry, consts):
            consts, carry = barrier(consts, carry)
            buf, log = carry
            plans, b, toks, kv0 = consts
            cb = canary_batch(b, step_ids(scn, m, b, toks))
            srcs = sources_of(((kv0,), ()), m, ps, rb)[0][0] if with_src else ()
            out = cj.write(
                ctx(buf, tag, log, srcs, mode),
                plans.per_group[0][1],
                cb.input_ids,
                cb.positions,
                cb.out_cache_loc,
                backend=backend,
            )
            return out.canary_buf, out.log

        return fn

    def sweep_fn(mode):
        def fn(state, consts):
            consts, state = barrier(consts, state)
            b, kv0 = consts
            plan = build_sweep_plan_from_requests(
                req_to_token=b["r2t"],
                req_pool_indices=b["sweep_rpi"],
                seq_lens=b["sweep_lens"],
                verify_capacity=bucket(scn.sweep_entries),
            )
            return canary_sweep(state, (plan,), config=cfg[mode], real_kv_sources=sources_of(((kv0,), ()), m, ps, rb))

        return fn

    out = {
        "plan": (plan_fn, head_mode),
        "head_verify": (verify_fn(CanaryLaunchTag.HEAD_K_FULL, head_mode, False), head_mode),
        "head_write": (write_fn(CanaryLaunchTag.HEAD_K_FULL, head_mode, False), head_mode),
    }
    for x in canary_modes:
        out[f"tail_verify:{x}"] = (verify_fn(CanaryLaunchTag.TAIL_K_FULL, x, x != "none"), x)
        out[f"tail_write:{x}"] = (write_fn(CanaryLaunchTag.TAIL_K_FULL, x, x != "none"), x)
        if args.sweep_interval > 0:
            out[f"sweep:{x}"] = (sweep_fn(x), x)
    return out


def part_args(name, state, plans, b, toks, kv):
    """(carry, consts) of a part's program: copies of the state's buffers, so the step's state is untouched."""
    g = state.groups[0]
    cp = functools.partial(jax.tree.map, lambda a: jnp.copy(a) if isinstance(a, jax.Array) else a)
    kv0 = kv[0][0]
    kind = name.split(":")[0]
    if kind == "plan":
        return cp(plans), (state, b, toks)
    if kind == "head_verify":
        return cp(state.log), (g.k_head, plans, kv0)
    if kind == "head_write":
        return (cp(g.k_head), cp(state.log)), (plans, b, toks, kv0)
    if kind == "tail_verify":
        return cp(state.log), (g.k_tail, plans, kv0)
    if kind == "tail_write":
        return (cp(g.k_tail), cp(state.log)), (plans, b, toks, kv0)
    return cp(state), (b, kv0)


def loop_of(fn, n):
    def many(carry, consts):
        return jax.lax.fori_loop(0, n, lambda i, c: fn(c, consts), carry)

    return jax.jit(many, donate_argnums=(0,))


def plan_of(scn, m, mode, args):
    cfg = canary_config(scn, mode, args.backend)
    return lambda s, bb, tt: canary_plan(s, canary_batch(bb, step_ids(scn, m, bb, tt)), config=cfg)
