"""``canary-jax`` command line: ``demo`` (serving loop + fault campaign) and ``verify-dump``.

Exit status: see ``DEMO_EXIT_CODES`` / ``VERIFY_EXIT_CODES`` (also printed by ``--help``). Bad input is one
line on stderr (``canary-jax: error: ...``) with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import sys
import textwrap
import time
from typing import Callable, Sequence

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
WIDTH = 120  # the longest line the demo's own report prints (SGLang's violation texts are longer, by format)

DEMO_EXIT_CODES = """\
exit status:
  0    every fault the configuration should catch was caught (expected misses and kinds not
       applicable to the model are reported, not failed), and no false positives
  1    a fault that should be caught went undetected, a fault could not be injected, a false
       positive, or a canary health-check error
  2    bad input, as one line on stderr: unknown fault kind, impossible sizes, a workload too short
       for the requested faults (raise --requests / --max-new-tokens), unwritable --json/--plot/--dump
  130  interrupted"""

VERIFY_EXIT_CODES = """\
exit status:
  0    no violations (none recorded in the ring, none found re-verifying a canary buffer)
  1    violations found
  2    bad input, as one line on stderr: missing, unreadable or unrecognised file, unwritable --json"""

# Config field names in ConfigError / ValueError messages -> the flags that set them.
_FIELD_FLAGS = {
    "num_pages": "--pool-pages", "page_size": "--page-size", "max_running": "--max-running",
    "max_tokens_per_step": "--max-tokens-per-step", "chunk_size": "--chunk-size", "max_context": "--max-context",
    "sweep_interval": "--sweep-interval", "num_requests": "--requests", "max_new_tokens": "--max-new-tokens",
    "detect_window": "--detect-window", "num_layers": "--layers", "d_model": "--d-model",
    "num_q_heads": "--q-heads", "num_kv_heads": "--kv-heads", "head_dim": "--head-dim",
}
_FIELD_RE = re.compile(r"(?<![\w-])(" + "|".join(sorted(_FIELD_FLAGS, key=len, reverse=True)) + r")(?!\w)")


def flagify(message: str) -> str:
    """Names the CLI flags instead of the config fields in a config error message."""
    return _FIELD_RE.sub(lambda m: _FIELD_FLAGS[m.group(1)], message)


class UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        # "argument --seed: --seed must be ..." -> "--seed must be ..." (our type checks name the flag)
        m = re.match(r"argument (\S+?)(?:/\S+)?: (.*)$", message, re.S)
        if m and m.group(2).startswith(m.group(1) + " "):
            message = m.group(2)
        raise UsageError(message)


def _int_at_least(name: str, minimum: int, maximum: int | None = None):
    """argparse type: an integer in ``[minimum, maximum]``, with a one-line message naming the flag."""

    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if maximum is not None and not minimum <= v <= maximum:
            raise argparse.ArgumentTypeError(f"{name} must be between {minimum} and {maximum}, got {v}")
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {v}")
        return v

    return conv


def _positive(name: str):
    return _int_at_least(name, 1)


def _nonneg(name: str):
    return _int_at_least(name, 0)


def build_parser() -> argparse.ArgumentParser:
    from canary_jax.cli.demo.campaign import MAX_SEED
    from canary_jax.cli.demo.faults import FAULT_KINDS

    raw = argparse.RawDescriptionHelpFormatter
    p = _Parser(prog="canary-jax", formatter_class=raw,
                description="KV-cache canary for JAX: serving demo with fault injection, and a decoder for saved "
                            "canary state.",
                epilog="With no command, canary-jax runs the demo: `canary-jax` is `canary-jax demo`, and\n"
                       "`canary-jax --trials 1` is `canary-jax demo --trials 1`.\n"
                       "`canary-jax demo --help` and `canary-jax verify-dump --help` list each command's flags\n"
                       "and exit codes.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="{demo,verify-dump}")
    d = sub.add_parser("demo", help="(the default) serve a batch of requests under the canary and run a fault "
                                    "campaign", formatter_class=raw, epilog=DEMO_EXIT_CODES,
                       description="Serve real text prompts with a small paged-KV transformer under the KV canary,\n"
                                   "inject faults, report detection. Defaults run every fault kind. This is also\n"
                                   "what a bare `canary-jax [flags]` runs.")
    g = d.add_argument_group("faults")
    g.add_argument("--inject", default="all", metavar="KIND[,KIND...]",
                   help=f"fault kinds to inject: all (default), none, or a comma list of {', '.join(FAULT_KINDS)}")
    g.add_argument("--trials", type=_positive("--trials"), default=3, help="episodes per fault kind (default 3)")
    g.add_argument("--detect-window", type=_positive("--detect-window"), default=24,
                   help="steps after an injection before the fault counts as missed (default 24)")
    c = d.add_argument_group("canary")
    c.add_argument("--real-kv", "--real-kv-mode", dest="real_kv", choices=("none", "partial", "all"), default="all",
                   help="real-KV fingerprint of layer 0's K pool: none, partial (first 16 bytes) or all (default)")
    c.add_argument("--sweep-interval", type=_nonneg("--sweep-interval"), default=4,
                   help="steps between sweeps of the prefix cache, 0 = off (default 4)")
    c.add_argument("--no-token-oracle", action="store_true",
                   help="turn off the write-input and verify-token asserts (token swaps then go unseen)")
    c.add_argument("--mha-v", action="store_true",
                   help="also run the V-half endpoints (SGLang's SGLANG_KV_CANARY_ENABLE_MHA_V; default K only)")
    c.add_argument("--backend", choices=("auto", "reference", "pallas"), default="auto",
                   help="canary kernels: auto (Pallas on GPU, jnp reference elsewhere), reference, pallas")
    s = d.add_argument_group("serving")
    s.add_argument("--requests", type=_positive("--requests"), default=24, help="requests to serve (default 24)")
    s.add_argument("--max-new-tokens", type=_positive("--max-new-tokens"), default=16,
                   help="tokens generated per request (default 16)")
    s.add_argument("--page-size", type=_positive("--page-size"), default=4, help="KV slots per page (default 4)")
    s.add_argument("--pool-pages", type=_int_at_least("--pool-pages", 2), default=256,
                   help="pages in the KV pool incl. the reserved page 0 (default 256)")
    s.add_argument("--max-running", type=_positive("--max-running"), default=8,
                   help="concurrent requests / batch rows (default 8)")
    s.add_argument("--max-tokens-per-step", type=_positive("--max-tokens-per-step"), default=64,
                   help="token capacity of one forward (default 64)")
    s.add_argument("--chunk-size", type=_positive("--chunk-size"), default=32,
                   help="longest prefill chunk per request per step (default 32)")
    s.add_argument("--max-context", type=_int_at_least("--max-context", 2), default=192,
                   help="req_to_token width: prompt + new tokens must fit (default 192)")
    s.add_argument("--prompts", metavar="PATH", default=None, help="prompt file (default: the packaged prompts)")
    m = d.add_argument_group("model")
    m.add_argument("--layers", type=_positive("--layers"), default=2)
    m.add_argument("--d-model", type=_positive("--d-model"), default=64)
    m.add_argument("--q-heads", type=_positive("--q-heads"), default=4)
    m.add_argument("--kv-heads", type=_positive("--kv-heads"), default=2)
    m.add_argument("--head-dim", type=_positive("--head-dim"), default=32)
    o = d.add_argument_group("output")
    o.add_argument("--seed", type=_int_at_least("--seed", 0, MAX_SEED), default=0,
                   help=f"weights, workload and injection seed, 0..{MAX_SEED} (default 0)")
    o.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    o.add_argument("--plot", metavar="PATH", help="write a PNG chart of detection per fault kind")
    o.add_argument("--dump", metavar="PATH",
                   help="save the canary state (.npz) of the first episode that detected a fault, for verify-dump")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("-v", "--verbose", action="store_true",
                   help="also print each episode's first violation in SGLang's report text")

    v = sub.add_parser("verify-dump", help="decode a saved violation ring / canary buffer (.npy or .npz)",
                       formatter_class=raw, epilog=VERIFY_EXIT_CODES,
                       description="Decode a violation ring (int64[R,8] or uint32[R,8,2]) or canary buffers\n"
                                   "(uint8[N,>=32]) saved from a live server into the violation report.")
    v.add_argument("path", help=".npy or .npz file")
    v.add_argument("--write-index", type=_nonneg("--write-index"), default=None,
                   help="violations recorded (default: the file's write index; without one, the rows up to the "
                        "last non-zero ring row, with a warning)")
    v.add_argument("--start", type=_nonneg("--start"), default=0, help="first ring row to report")
    v.add_argument("--json", metavar="PATH", help="write the decoded report as JSON")
    v.add_argument("--max-messages", type=_nonneg("--max-messages"), default=20,
                   help="formatted violation messages to print per ring (default 20)")
    return p


def _check_out_path(flag: str, path: str | None, suffix: str | None = None) -> None:
    """Refuses an output path that cannot be written, before any work is done.

    Opens the path for append and closes it again (a file that did not exist is removed again), so a
    read-only file, a missing or read-only directory or a path under /proc fails now, not after the run.
    """
    if path is None:
        return
    if not path or os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a directory or empty; give a file path")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {path!r}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{flag} {path!r}: directory {parent} is not writable")
    if suffix and not path.lower().endswith(suffix):
        raise UsageError(f"{flag} {path!r} must end in {suffix}")
    if os.path.realpath(path).startswith(("/proc/", "/sys/")):  # opens fine as root, then fails on write
        raise UsageError(f"{flag} {path!r} is not writable: a kernel pseudo-file, not an output file")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise UsageError(f"{flag} {path!r}: {e.strerror or e}") from None
    try:
        if st is None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            os.close(fd)
            os.unlink(path)
        elif not stat.S_ISFIFO(st.st_mode):  # a FIFO would block until a reader comes
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
            os.close(fd)
    except FileExistsError:  # created by someone else meanwhile: theirs, leave it
        pass
    except OSError as e:
        raise UsageError(f"{flag} {path!r} is not writable: {e.strerror or e}") from None


def _write_output(flag: str, path: str, write: Callable[[str], None], errors: list[str]) -> None:
    """Runs ``write(path)``; a failure (disk full, /dev/full, permissions) becomes one line in ``errors``."""
    try:
        write(path)
    except OSError as e:
        errors.append(f"{flag} {path!r}: cannot write: {e.strerror or e}")


def _write_json(obj) -> Callable[[str], None]:
    def write(path: str) -> None:
        with open(path, "w") as f:
            json.dump(obj, f, indent=1, default=str)

    return write


# --- demo ------------------------------------------------------------------------------------------------
def _demo(args) -> int:
    from canary_jax import constants
    from canary_jax.cli.demo import campaign
    from canary_jax.cli.demo import engine
    from canary_jax.cli.demo import faults
    from canary_jax.cli.demo import model
    from canary_jax.cli import render
    from canary_jax.cli.demo.workload import PromptFileError

    try:
        kinds = faults.parse_kinds(args.inject)
    except ValueError as e:
        raise UsageError(str(e)) from None
    _check_out_path("--json", args.json)
    _check_out_path("--plot", args.plot, ".png")
    _check_out_path("--dump", args.dump, ".npz")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib (pip install matplotlib)") from None
    if args.prompts is not None and not os.path.isfile(args.prompts):
        raise UsageError(f"--prompts {args.prompts!r}: file not found")
    try:
        model_cfg = model.ModelConfig(num_layers=args.layers, d_model=args.d_model, num_q_heads=args.q_heads,
                                  num_kv_heads=args.kv_heads, head_dim=args.head_dim, d_ff=2 * args.d_model,
                                  seed=args.seed)
        engine_cfg = engine.EngineConfig(
            page_size=args.page_size, num_pages=args.pool_pages, max_running=args.max_running,
            max_tokens_per_step=args.max_tokens_per_step, chunk_size=args.chunk_size, max_context=args.max_context,
            real_kv_hash_mode=constants.RealKvHashMode.from_name(args.real_kv), sweep_interval=args.sweep_interval,
            token_oracle=not args.no_token_oracle, backend=None if args.backend == "auto" else args.backend,
            enable_v_half=args.mha_v)
        cfg = campaign.CampaignConfig(engine=engine_cfg, model=model_cfg, num_requests=args.requests,
                               max_new_tokens=args.max_new_tokens, trials=args.trials,
                               detect_window=args.detect_window, seed=args.seed, prompt_path=args.prompts)
    except ValueError as e:
        raise UsageError(flagify(str(e))) from None
    if args.inject.strip().lower() != "all":  # asked for by name: a kind the model cannot host is an error
        for f in kinds:
            why = f.not_applicable(model_cfg)
            if why:
                raise UsageError(f"--inject {f.kind} is impossible here: {why}; raise --head-dim or --kv-heads, "
                                 f"or leave {f.kind} out")

    t0 = time.perf_counter()
    try:
        camp = campaign.Campaign(cfg, kinds, dump_path=args.dump)
    except (engine.ConfigError, PromptFileError) as e:
        raise UsageError(flagify(str(e))) from None

    bar = None
    state = {"label": ""}
    if not args.no_progress:
        from tqdm import tqdm

        episodes = sum(1 for f in kinds if f.kind not in camp.not_applicable) * args.trials
        bar = tqdm(total=1 + episodes, unit="episode", desc="canary-jax demo", file=sys.stderr,
                   dynamic_ncols=True, leave=False, disable=None)

    def on_episode(label: str) -> None:
        if bar is not None and state["label"]:
            bar.update(1)
        state["label"] = label

    def on_step(label: str, step: int) -> None:
        if bar is not None:
            bar.set_postfix_str(f"{label} step {step}", refresh=False)
            bar.refresh() if step % 8 == 0 else None

    camp.on_step, camp.on_episode = on_step, on_episode
    try:
        result = camp.run()
    finally:
        if bar is not None:
            bar.update(1)
            bar.close()
    summary = campaign.summarize(result)
    summary["wall_s"] = round(time.perf_counter() - t0, 2)
    if args.dump:
        summary["dump"] = dict(path=args.dump, episode=camp.dumped)
    if args.verbose:
        render.render_violation_samples(summary)
    render.render_text(summary, verbose=args.verbose)
    print(f"{summary['steps']} forward steps in {summary['wall_s']} s (incl. compile)")
    errors: list[str] = []
    if args.json:
        _write_output("--json", args.json, _write_json(summary), errors)
    if args.plot:
        _write_output("--plot", args.plot, lambda path: render.plot(summary, path), errors)
    if args.dump:
        if camp.dump_error:
            errors.append(f"--dump {args.dump!r}: cannot write: {camp.dump_error}")
        else:
            print(f"canary state of episode {camp.dumped} saved to {args.dump}" if camp.dumped
                  else f"no episode detected a fault; nothing saved to {args.dump}")
    if errors:
        raise UsageError("; ".join(errors))
    return EXIT_OK if summary["ok"] else EXIT_FAIL


# --- verify-dump -----------------------------------------------------------------------------------------
def _verify_dump(args) -> int:
    from canary_jax.cli import verify_dump
    from canary_jax.cli import render

    _check_out_path("--json", args.json)
    try:
        rep = verify_dump.load_and_report(args.path, write_index=args.write_index, start=args.start)
    except verify_dump.DumpError as e:
        raise UsageError(str(e)) from None
    for w in rep["warnings"]:
        print(textwrap.fill(f"canary-jax: warning: {w}", WIDTH, subsequent_indent="  "), file=sys.stderr)
    total = 0
    for ring in rep["rings"]:
        total += ring["decoded"]
        _print_ring(ring, args.max_messages, render)
    for buf in rep["buffers"]:
        cen = buf["census"]
        print(textwrap.fill(
            f"{buf['name']}: {buf['num_slots']} slots, {cen['records']} non-empty records, "
            f"{cen['broken_links']} records whose prev_hash matches no record at the previous position"
            + (" (stale records of freed slots also show up here)" if cen["broken_links"] else ""),
            WIDTH, subsequent_indent="  "))
        if "verify" in buf:
            ring = buf["verify"]
            total += ring["decoded"]
            if not ring["real_kv_checked"]:
                print(f"  ({buf['name']}: real-KV fingerprints not checked: no k_buffer in the dump or a HEAD buffer)")
            _print_ring(ring, args.max_messages, render)
    if args.json:
        errors: list[str] = []
        _write_output("--json", args.json, _write_json(rep), errors)
        if errors:
            raise UsageError("; ".join(errors))
    return EXIT_FAIL if total else EXIT_OK


def _print_ring(ring: dict, max_messages: int, render) -> None:
    if "verified_entries" in ring:  # a re-verified canary buffer: its scratch ring is sized to the entries
        print(f"{ring['name']}: {ring['write_index']} violations in {ring['verified_entries']} verified entries "
              f"(the live requests' slots), {ring['decoded']} decoded")
    else:
        frm = f" from row {ring['start']}" if ring.get("start") else ""
        count = (f"{ring['write_index']} violations recorded" if ring["write_index"] >= 0 else
                 f"write index {ring['write_index']} (the int32 counter wrapped past 2**31 - 1 violations)")
        print(f"{ring['name']}: {count}, {ring['decoded']} decoded{frm} "
              f"(ring capacity {ring['ring_capacity']}{', OVERFLOWED' if ring['ring_overflow'] else ''})")
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
        if args.command == "verify-dump":
            return _verify_dump(args)
        return _demo(args)
    except UsageError as e:
        print(f"canary-jax: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("canary-jax: interrupted", file=sys.stderr)
        return 130
