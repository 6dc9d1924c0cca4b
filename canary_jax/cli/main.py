"""``canary-jax`` command line: ``demo`` (serving loop + fault campaign) and ``verify-dump``.

:func:`main` dispatches to the commands. The parser and exit codes live in :mod:`canary_jax.cli.args`, output
files in :mod:`canary_jax.cli.outputs`, the progress bar in :mod:`canary_jax.cli.progress`, tables and the chart
in :mod:`canary_jax.cli.render`, and the dump decoder in :mod:`canary_jax.cli.verify_dump`.

Exit status: see ``DEMO_EXIT_CODES`` / ``VERIFY_EXIT_CODES`` in :mod:`canary_jax.cli.args` (also printed by
``--help``). Bad input is one line on stderr (``canary-jax: error: ...``) with status 2, never a traceback.
When the reader of stdout goes away (``canary-jax verify-dump FILE | head``), the command stops quietly with
status 141 (``EXIT_BROKEN_PIPE``), as POSIX tools do: no traceback, no "Exception ignored" at exit.
"""

from __future__ import annotations

import os
import sys
import textwrap
import time
from collections.abc import Sequence

from canary_jax.cli.args import (
    DEMO_EXTRA_HINT,
    EXIT_BROKEN_PIPE,
    EXIT_FAIL,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    build_parser,
    flagify,
)
from canary_jax.cli.outputs import check_out_path, write_json, write_output


# --- demo ------------------------------------------------------------------------------------------------
def _demo(args) -> int:
    from canary_jax.cli import chart, progress, render
    from canary_jax.cli.demo import campaign, engine, faults, model
    from canary_jax.cli.demo.summary import summarize
    from canary_jax.cli.demo.workload import PromptFileError
    from canary_jax.contract import constants
    from canary_jax.ops import backends

    try:
        kinds = faults.parse_kinds(args.inject)
    except ValueError as e:
        raise UsageError(str(e)) from None
    check_out_path("--json", args.json)
    check_out_path("--plot", args.plot, ".png")
    check_out_path("--dump", args.dump, ".npz")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError(f"--plot needs matplotlib, which is not installed: {DEMO_EXTRA_HINT}") from None
    if args.backend == "auto":  # the default reads $CANARY_JAX_BACKEND: a bad name is a usage error, not a crash
        env = os.environ.get(backends.BACKEND_ENV) or None
        if env is not None:
            try:
                backends.check_backend_name(env)
            except ValueError:
                raise UsageError(
                    f"${backends.BACKEND_ENV}={env!r}: backend must be one of {backends.BACKENDS}"
                ) from None
    if args.prompts is not None and not os.path.isfile(args.prompts):
        raise UsageError(f"--prompts {args.prompts!r}: file not found")
    campaign_cls = campaign.Campaign
    if args.devices is not None:  # the canary sharded over N devices by KV heads
        from canary_jax.cli.demo import sharded as demo_sharded

        if args.dump:
            raise UsageError("--dump is not supported with --devices (a dump holds one canary)")
        why = demo_sharded.force_host_devices(args.devices)
        if why:
            raise UsageError(why)
        args.kv_heads, args.q_heads, why = demo_sharded.fit_kv_heads(args.kv_heads, args.q_heads, args.devices)
        if why:
            demo_sharded.note(why)
        campaign_cls = demo_sharded.campaign_class(args.devices)
    try:
        model_cfg = model.ModelConfig(
            num_layers=args.layers,
            d_model=args.d_model,
            num_q_heads=args.q_heads,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            d_ff=2 * args.d_model,
            seed=args.seed,
        )
        engine_cfg = engine.EngineConfig(
            page_size=args.page_size,
            num_pages=args.pool_pages,
            max_running=args.max_running,
            max_tokens_per_step=args.max_tokens_per_step,
            chunk_size=args.chunk_size,
            max_context=args.max_context,
            real_kv_hash_mode=constants.RealKvHashMode.from_name(args.real_kv),
            sweep_interval=args.sweep_interval,
            token_oracle=not args.no_token_oracle,
            backend=None if args.backend == "auto" else args.backend,
            enable_v_half=args.mha_v,
        )
        cfg = campaign.CampaignConfig(
            engine=engine_cfg,
            model=model_cfg,
            num_requests=args.requests,
            max_new_tokens=args.max_new_tokens,
            trials=args.trials,
            detect_window=args.detect_window,
            seed=args.seed,
            prompt_path=args.prompts,
        )
    except ValueError as e:
        raise UsageError(flagify(str(e))) from None
    if args.inject.strip().lower() != "all":  # asked for by name: a kind the model cannot host is an error
        for f in kinds:
            why = f.not_applicable(model_cfg)
            if why:
                raise UsageError(
                    f"--inject {f.kind} is impossible here: {why}; raise --head-dim or --kv-heads, "
                    f"or leave {f.kind} out"
                )

    t0 = time.perf_counter()
    try:
        camp = campaign_cls(cfg, kinds, dump_path=args.dump)
    except (engine.ConfigError, PromptFileError) as e:
        raise UsageError(flagify(str(e))) from None

    episodes = sum(1 for f in kinds if f.kind not in camp.not_applicable) * args.trials
    bar = progress.open_progress(1 + episodes, enabled=not args.no_progress)  # the clean phase + the episodes
    camp.on_step, camp.on_episode = bar.on_step, bar.on_episode
    try:
        result = camp.run()
    finally:
        bar.close()
    summary = summarize(result)
    summary["wall_s"] = round(time.perf_counter() - t0, 2)
    if args.dump:
        summary["dump"] = dict(path=args.dump, episode=camp.dumped)
    if args.verbose:
        render.render_violation_samples(summary)
    render.render_text(summary, verbose=args.verbose)
    if args.devices is not None:
        print("\n".join(demo_sharded.shard_lines(result)))
    print(f"{summary['steps']} forward steps in {summary['wall_s']} s (incl. compile)")
    errors: list[str] = []
    if args.json:
        write_output("--json", args.json, write_json(summary), errors)
    if args.plot:
        write_output("--plot", args.plot, lambda path: chart.plot(summary, path), errors)
    if args.dump:
        if camp.dump_error:
            errors.append(f"--dump {args.dump!r}: cannot write: {camp.dump_error}")
        else:
            print(
                f"canary state of episode {camp.dumped} saved to {args.dump}"
                if camp.dumped
                else f"no episode detected a fault; nothing saved to {args.dump}"
            )
    if errors:
        raise UsageError("; ".join(errors))
    return EXIT_OK if summary["ok"] else EXIT_FAIL


# --- verify-dump -----------------------------------------------------------------------------------------
def _verify_dump(args) -> int:
    from canary_jax.cli import render, verify_dump

    check_out_path("--json", args.json)
    try:
        rep = verify_dump.load_and_report(args.path, write_index=args.write_index, start=args.start)
    except verify_dump.DumpError as e:
        raise UsageError(str(e)) from None
    for w in rep["warnings"]:
        print(textwrap.fill(f"canary-jax: warning: {w}", render.WIDTH, subsequent_indent="  "), file=sys.stderr)
    total = 0
    for ring in rep["rings"]:
        total += ring["decoded"]
        _print_ring(ring, args.max_messages, render)
    for buf in rep["buffers"]:
        cen = buf["census"]
        print(
            textwrap.fill(
                f"{buf['name']}: {buf['num_slots']} slots, {cen['records']} non-empty records, "
                f"{cen['broken_links']} records whose prev_hash matches no record at the previous position"
                + (" (stale records of freed slots also show up here)" if cen["broken_links"] else ""),
                render.WIDTH,
                subsequent_indent="  ",
            )
        )
        if "verify" in buf:
            ring = buf["verify"]
            total += ring["decoded"]
            if not ring["real_kv_checked"]:
                print(f"  ({buf['name']}: real-KV fingerprints not checked: no k_buffer in the dump or a HEAD buffer)")
            _print_ring(ring, args.max_messages, render)
    if args.json:
        errors: list[str] = []
        write_output("--json", args.json, write_json(rep), errors)
        if errors:
            raise UsageError("; ".join(errors))
    return EXIT_FAIL if total else EXIT_OK


def _print_ring(ring: dict, max_messages: int, render) -> None:
    if "verified_entries" in ring:  # a re-verified canary buffer: its scratch ring is sized to the entries
        print(
            f"{ring['name']}: {ring['write_index']} violations in {ring['verified_entries']} verified entries "
            f"(the live requests' slots), {ring['decoded']} decoded"
        )
    else:
        frm = f" from row {ring['start']}" if ring.get("start") else ""
        count = (
            f"{ring['write_index']} violations recorded"
            if ring["write_index"] >= 0
            else f"write index {ring['write_index']} (the int32 counter wrapped past 2**31 - 1 violations)"
        )
        print(
            f"{ring['name']}: {count}, {ring['decoded']} decoded{frm} "
            f"(ring capacity {ring['ring_capacity']}{', OVERFLOWED' if ring['ring_overflow'] else ''})"
        )
    if ring["by_reason"]:
        print(render.table(["launch:fail reasons", "rows"], [[k, str(v)] for k, v in ring["by_reason"].items()]))
    for msg in ring["messages"][:max_messages]:
        print(msg)
    if len(ring["messages"]) > max_messages:
        print(f"... {len(ring['messages']) - max_messages} more (raise --max-messages)")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and not argv[0].startswith("-") and argv[0] not in ("demo", "verify-dump"):
            raise UsageError(f"unknown command {argv[0]!r} (commands: demo, verify-dump)")
        if not argv or argv[0] not in ("demo", "verify-dump", "-h", "--help"):
            argv = ["demo"] + argv  # bare `canary-jax [flags]` runs the demo
        args = build_parser().parse_args(argv)
        rc = _verify_dump(args) if args.command == "verify-dump" else _demo(args)
        sys.stdout.flush()  # a closed pipe shows up here, not in the interpreter's exit flush
        return rc
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except UsageError as e:
        print(f"canary-jax: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("canary-jax: interrupted", file=sys.stderr)
        return 130


def _silence_stdout() -> None:
    """Points file descriptor 1 at the null device, so the interpreter's flush of what is still buffered at exit
    cannot raise a second BrokenPipeError (the recipe of Python's ``signal`` documentation)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is no file descriptor (captured in-process): nothing is left to flush
        pass


if __name__ == "__main__":  # python -m canary_jax.cli.main [demo|verify-dump] ...
    sys.exit(main())
