"""Write in one launch over a grid, ``canary_write_grid`` (:func:`write_grid_kernel`): the passes of the multi-launch
write (:mod:`pallas_kernels.write`) in one kernel of a few programs, with grid barriers where the launch boundaries
were.

The multi-launch write needs five kernels (the flag memset, chain, claim, won, store) because each pass needs every
program's work of the pass before done: the flags zeroed before the chains set them, every seed read and claim word
zeroed before any claim, every claim before a winner is read, every winner known before a record overwrites its
claim word. A decode step of thousands of one-token requests spends more on those boundaries than on its work
(13.8 us for 4096 requests on the H200, against 5.9 us for the CUDA peer that stores without ordering). Here the
programs meet at a grid barrier instead:

0. the flag words of each program's entry blocks are zeroed, and program 0 copies the write index (the rows' base);
1. the serial chains, one request per lane (:func:`pallas_kernels.write_chain._chain_role`, each program its share
   of the requests in one lane block), and, with real-KV sources, the fingerprints (``_entry_role``);
2. the claim (:func:`pallas_kernels.write_claim.write_claim_kernel`: a vector atomic max per block, compiled);
3. the winners and per-block counts (:func:`pallas_kernels.write_won.write_won_kernel`);
4. the commit (:func:`pallas_kernels.write_commit.write_commit_kernel`).

A barrier is ``__syncthreads`` (the program's stores are done), one acquire-release ``atomic_add`` on the log's
``launch_ticket``, then atomic reads of it until every program has arrived (``k * programs`` arrivals at the
``k``-th barrier), then ``__syncthreads`` again: the release and acquire of :mod:`pallas_kernels.phase`'s ticket,
waited for by every program. After the commit each program arrives once more and the last one zeroes the ticket
(every other program has then left its last wait).

A spin barrier needs every program resident at once: the grid is at most ``PallasConfig.write_grid_programs``
programs and at most the GPU's multiprocessor count (each program fits a multiprocessor alone, so the programs of
this launch only ever wait for other kernels' programs to finish, never for each other). The words are passed as
their float32 view, which the claim's atomic max needs (:func:`pallas_kernels.refs.atomic_max_word`); every other
pass loads and stores them bit for bit through :func:`pallas_kernels.refs.words_view`.

Interpreted (CPU), the kernel is one program that runs each pass for every program in turn (a loop over the program
ids): the passes, their partition and their order are the compiled ones, the barriers are no-ops, and the claim is
the retry loop of the multi-launch write's interpreted claim. Bit for bit
:func:`canary_jax.ops.reference.write_reference` for plans within the contract, as every Pallas write.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import calls, refs
from pallas_kernels.write_chain import _chain_role, _entry_role
from pallas_kernels.write_claim import write_claim_kernel
from pallas_kernels.write_commit import write_commit_kernel
from pallas_kernels.write_won import write_won_kernel

PASSES = 5
"""Arrivals of each program at the ticket: four barriers, then the last arrival that zeroes it."""


def gpu_cores() -> int | None:
    """The fewest multiprocessors of this process's GPUs (``Device.core_count``), None where there is no GPU or
    the runtime does not say."""
    cores = [getattr(d, "core_count", None) for d in jax.local_devices() if d.platform == "gpu"]
    cores = [c for c in cores if isinstance(c, int) and c > 0]
    return min(cores) if cores else None


def grid_programs(num_tokens: int, block: int, max_programs: int, interpret: bool) -> int:
    """Programs of a grid write of ``num_tokens`` tokens: one per entry block of ``block``, at most
    ``max_programs`` and, compiled, at most the GPU's multiprocessors (:func:`gpu_cores`, see the module
    docstring: every program must be resident at once)."""
    p = max(1, min(-(-num_tokens // block), max_programs))
    cores = None if interpret else gpu_cores()
    return p if cores is None else max(1, min(p, cores))


def _barrier(ticket_ref, k: int, programs: int, interpret: bool) -> None:
    """The ``k``-th grid barrier (see the module docstring); a no-op interpreted, where programs run in turn."""
    if interpret:
        return
    refs.barrier(False)
    zero = (jnp.int32(0),)
    arrived = pltriton.atomic_add(ticket_ref, zero, jnp.int32(1)) + 1
    jax.lax.while_loop(
        lambda seen: seen < k * programs, lambda _: pltriton.atomic_add(ticket_ref, zero, jnp.int32(0)), arrived
    )
    refs.barrier(False)


def write_grid_kernel(*all_refs, names, programs, descs, lanes, prefetch, entry_block, block, chain_statics, **statics):
    """The five passes (module docstring); ``names`` the refs' names in order (``in_*`` operands, ``out_*``
    outputs). ``chain_statics`` are the chain role's (n_slots, cw, num_tokens, hasher, gather, assert_inputs),
    ``statics`` the commit's and the entry role's."""
    r = dict(zip(names, all_refs, strict=True))
    interpret = statics["interpret"]
    num_tokens = chain_statics["num_tokens"]
    words, flags, counts = r["out_words"], r["out_flags"], r["out_counts"]
    prev_at, chain_exp, ticket = r["out_prev_at"], r["out_chain_exp"], r["out_ticket"]
    rkv = r.get("out_rkv")
    flat = tuple(r[f"in_{k}"] for k in ("ids", "pos", "loc", "exp_tok", "exp_pos"))
    loc = flat[2]
    srcs = [r[f"in_source{k}"] for k in range(len(descs))]
    nb = refs.cdiv(num_tokens, block)

    def each(fn):  # fn(pid, programs) for every program: this one compiled, all in turn interpreted
        if interpret:
            jax.lax.fori_loop(0, programs, lambda vp, c: (fn(vp, programs), c)[1], jnp.int32(0))
        else:
            fn(refs.program_id(), programs)

    def zero_flags(pid, g):
        def body(b):
            i = b * block + refs.iota(block)
            refs.store_vec(flags, i, jnp.zeros((block,), jnp.uint32), i < num_tokens)

        refs.for_each_block(nb, body, pid=pid, programs=g)

        @pl.when(pid == 0)
        def _():
            r["out_base"][0] = r["in_write_index"][0]

    def chains(pid, g):
        head = (r["in_num_reqs"], r["in_assert_flag"], r["in_offsets"], r["in_seeds"], *flat)
        _chain_role(
            head,
            (words, flags, prev_at, chain_exp),
            pid=pid,
            programs=g,
            lanes=lanes,
            prefetch=prefetch,
            long_threshold=None,
            **chain_statics,
        )
        if descs:
            _entry_role(
                loc,
                srcs,
                rkv,
                pid=pid,
                programs=g,
                descs=descs,
                n_slots=chain_statics["n_slots"],
                num_tokens=num_tokens,
                block=entry_block,
                hasher=chain_statics["hasher"],
                gather=chain_statics["gather"],
                source_gather=statics["source_gather"],
                source_unroll=statics["source_unroll"],
                source_tile_words=statics["source_tile_words"],
            )

    def claim(pid, g):
        write_claim_kernel(
            loc, flags, words, words, num_tokens=num_tokens, block=block, interpret=interpret, pid=pid, programs=g
        )

    def won(pid, g):
        ids, pos = flat[0], flat[1]
        write_won_kernel(
            loc,
            ids,
            pos,
            words,
            flags,
            prev_at,
            chain_exp,
            flags,
            counts,
            prev_at,
            chain_exp,
            num_tokens=num_tokens,
            block=block,
            gather=chain_statics["gather"],
            hasher=chain_statics["hasher"],
            has_long=False,
            pid=pid,
            programs=g,
        )

    def commit(pid, g):
        write_commit_kernel(
            r["out_base"],
            *flat,
            prev_at,
            chain_exp,
            flags,
            counts,
            *([rkv] if descs else []),
            words,
            *(r[f"out_{k}"] for k in calls.LOG_OUTPUTS),
            has_rkv=bool(descs),
            tag=statics["tag"],
            counter_row=statics["counter_row"],
            num_tokens=num_tokens,
            block=block,
            ring_capacity=statics["ring_capacity"],
            gather=chain_statics["gather"],
            assert_inputs=chain_statics["assert_inputs"],
            pid=pid,
            programs=g,
        )

    for k, fn in enumerate((zero_flags, chains, claim, won, commit), start=1):
        each(fn)
        if k < PASSES:
            _barrier(ticket, k, programs, interpret)
    if not interpret:
        refs.barrier(False)
        last = pltriton.atomic_add(ticket, (jnp.int32(0),), jnp.int32(1))

        @pl.when(last == PASSES * programs - 1)
        def _():
            ticket[0] = jnp.int32(0)


def takes_grid(num_tokens: int, cw: int, has_rkv: bool, has_ticket: bool, config) -> bool:
    """Whether a write that does not take the one program (:func:`pallas_kernels.write.takes_fused`) runs as this
    one launch: a log with a launch ticket (``has_ticket``), at least one and at most ``write_grid_max_tokens``
    (``write_grid_max_hashed`` with real-KV sources) tokens, and no long-request role (the same rule as
    :func:`pallas_kernels.write._write_pallas`'s)."""
    long_on = num_tokens > config.write_long_threshold and num_tokens >= 2 * cw
    bound = config.write_grid_max_hashed if has_rkv else config.write_grid_max_tokens
    return has_ticket and 0 < num_tokens <= bound and not long_on


def write_grid(pro, plan, flat: dict, *, assert_inputs: bool, interpret: bool, config) -> tuple:
    """The one launch: ``(words, log)`` after the write (the log's ticket zero again). ``pro`` is the launch's
    :class:`~pallas_kernels.calls.Prologue` (its log has a launch ticket), ``flat`` the flat ``uint32[2 T]`` (or
    narrow ``int32[T]``) operands ``ids``, ``pos``, ``loc``, ``exp_tok``, ``exp_pos`` (the actual ones standing in
    for the expected ones without the assert), ``plan`` the :class:`~canary_jax.planning.plans.WritePlan`; traced
    under the write's ``jax.jit``."""
    num_tokens = refs.entries(flat["ids"])
    cw = int(plan.write_seed_slot_indices.shape[0])
    block = config.write_block
    programs = grid_programs(num_tokens, block, config.write_grid_programs, interpret)
    # each program runs its share of the requests as one lane block; a chunk load stays at most 4096 entries
    lanes = max(32, 1 << max(0, (-(-cw // programs) - 1).bit_length()))
    prefetch = max(1, min(config.write_prefetch, 2, 4096 // lanes))
    u32, i32, sds = jnp.uint32, jnp.int32, jax.ShapeDtypeStruct
    words = pro.words if interpret else jax.lax.bitcast_convert_type(pro.words, jnp.float32)
    args = dict(
        num_reqs=plan.write_num_valid_reqs,
        assert_flag=pro.log.enable_chain_position_assert,
        offsets=plan.write_offsets,
        seeds=plan.write_seed_slot_indices,
        **flat,
        **{f"source{k}": s for k, s in enumerate(pro.srcs)},
        words=words,
        ticket=pro.log.launch_ticket,
    )
    scratch = dict(
        flags=sds((num_tokens,), u32),
        prev_at=sds((2 * num_tokens,), u32),
        chain_exp=sds((2 * num_tokens,), u32),
        counts=sds((-(-num_tokens // block), 2), i32),
        base=sds((1,), i32),
    )
    if pro.descs:
        scratch["rkv"] = sds((num_tokens, 2), u32)
    outs = ("words", "ticket")
    log_names = calls.LOG_OUTPUTS
    names = tuple(f"in_{k}" for k in (*args, *log_names)) + tuple(f"out_{k}" for k in (*outs, *scratch, *log_names))
    kernel = functools.partial(
        write_grid_kernel,
        names=names,
        programs=programs,
        descs=pro.descs,
        lanes=lanes,
        prefetch=prefetch,
        entry_block=config.write_entry_block,
        block=block,
        chain_statics=dict(
            n_slots=pro.n_slots,
            cw=cw,
            num_tokens=num_tokens,
            hasher=pro.hasher,
            gather=config.gather,
            assert_inputs=assert_inputs,
        ),
        tag=pro.tag,
        counter_row=pro.counter_row,
        source_gather=config.source_gather,
        source_unroll=config.source_unroll,
        source_tile_words=config.write_source_tile_words,
        interpret=interpret,
    )
    (words, ticket, *_), log = calls.call_with_log(
        kernel,
        args,
        pro.log,
        outs=outs,
        scratch=scratch,
        grid=(1 if interpret else programs,),
        compiler_params=pltriton.CompilerParams(num_warps=config.write_grid_num_warps, num_stages=1),
        interpret=interpret,
        name="canary_write_grid",
    )
    if not interpret:
        words = jax.lax.bitcast_convert_type(words, jnp.uint32)
    return words, dataclasses.replace(log, launch_ticket=ticket)
