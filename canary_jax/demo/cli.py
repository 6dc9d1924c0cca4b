"""``canary-jax`` command line: ``demo`` (serving loop + fault campaign) and ``verify-dump``.

Exit status: 0 success; 1 a fault the configuration should catch went undetected, a fault could not be
injected, or a false positive; 2 bad input (unknown fault kind, impossible sizes, bad paths), reported as one
line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Sequence

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise UsageError(message)


def _int_at_least(name: str, minimum: int):
    """argparse type: an integer ``>= minimum``, with a one-line message naming the flag."""

    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {v}")
        return v

    return conv


def _positive(name: str):
    return _int_at_least(name, 1)


def _nonneg(name: str):
    return _int_at_least(name, 0)


def build_parser() -> argparse.ArgumentParser:
    from canary_jax.demo.faults import FAULT_KINDS

    p = _Parser(prog="canary-jax", description="KV-cache canary for JAX: serving demo with fault injection, "
                                               "and a decoder for saved canary state.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    d = sub.add_parser("demo", help="serve a batch of requests under the canary and run a fault campaign",
                       description="Serve real text prompts with a small paged-KV transformer under the KV canary, "
                                   "inject faults, report detection. Defaults run every fault kind.")
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
    s.add_argument("--pool-pages", type=_positive("--pool-pages"), default=256,
                   help="pages in the KV pool incl. the reserved page 0 (default 256)")
    s.add_argument("--max-running", type=_positive("--max-running"), default=8,
                   help="concurrent requests / batch rows (default 8)")
    s.add_argument("--max-tokens-per-step", type=_positive("--max-tokens-per-step"), default=64,
                   help="token capacity of one forward (default 64)")
    s.add_argument("--chunk-size", type=_positive("--chunk-size"), default=32,
                   help="longest prefill chunk per request per step (default 32)")
    s.add_argument("--max-context", type=_positive("--max-context"), default=192,
                   help="req_to_token width: prompt + new tokens must fit (default 192)")
    s.add_argument("--prompts", metavar="PATH", default=None, help="prompt file (default: the packaged prompts)")
    m = d.add_argument_group("model")
    m.add_argument("--layers", type=_positive("--layers"), default=2)
    m.add_argument("--d-model", type=_positive("--d-model"), default=64)
    m.add_argument("--q-heads", type=_positive("--q-heads"), default=4)
    m.add_argument("--kv-heads", type=_positive("--kv-heads"), default=2)
    m.add_argument("--head-dim", type=_positive("--head-dim"), default=32)
    o = d.add_argument_group("output")
    o.add_argument("--seed", type=_nonneg("--seed"), default=0, help="weights, workload and injection seed")
    o.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    o.add_argument("--plot", metavar="PATH", help="write a PNG chart of detection per fault kind")
    o.add_argument("--dump", metavar="PATH",
                   help="save the canary state (.npz) of the first episode that detected a fault, for verify-dump")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("-v", "--verbose", action="store_true",
                   help="also print each episode's first violation in SGLang's report text")

    v = sub.add_parser("verify-dump", help="decode a saved violation ring / canary buffer (.npy or .npz)",
                       description="Decode a violation ring (int64[R,8] or uint32[R,8,2]) or canary buffers "
                                   "(uint8[N,>=32]) saved from a live server into the violation report.")
    v.add_argument("path", help=".npy or .npz file")
    v.add_argument("--write-index", type=_nonneg("--write-index"), default=None,
                   help="violations recorded (default: from the file, else the leading non-empty ring rows)")
    v.add_argument("--start", type=_nonneg("--start"), default=0, help="first ring row to report")
    v.add_argument("--json", metavar="PATH", help="write the decoded report as JSON")
    v.add_argument("--max-messages", type=_nonneg("--max-messages"), default=20,
                   help="formatted violation messages to print per ring (default 20)")
    return p


def _check_out_path(flag: str, path: str | None, suffix: str | None = None) -> None:
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


# --- demo ------------------------------------------------------------------------------------------------
def _demo(args) -> int:
    from canary_jax import constants as C
    from canary_jax.demo import campaign as K
    from canary_jax.demo import engine as E
    from canary_jax.demo import faults as F
    from canary_jax.demo import model as M
    from canary_jax.demo import render
    from canary_jax.demo.workload import PromptFileError

    try:
        kinds = F.parse_kinds(args.inject)
    except ValueError as e:
        raise UsageError(str(e)) from None
    _check_out_path("--json", args.json)
    _check_out_path("--plot", args.plot, ".png")
    _check_out_path("--dump", args.dump, ".npz")
    if args.prompts is not None and not os.path.isfile(args.prompts):
        raise UsageError(f"--prompts {args.prompts!r}: file not found")
    try:
        model_cfg = M.ModelConfig(num_layers=args.layers, d_model=args.d_model, num_q_heads=args.q_heads,
                                  num_kv_heads=args.kv_heads, head_dim=args.head_dim, d_ff=2 * args.d_model,
                                  seed=args.seed)
        engine_cfg = E.EngineConfig(
            page_size=args.page_size, num_pages=args.pool_pages, max_running=args.max_running,
            max_tokens_per_step=args.max_tokens_per_step, chunk_size=args.chunk_size, max_context=args.max_context,
            real_kv_hash_mode=C.RealKvHashMode.from_name(args.real_kv), sweep_interval=args.sweep_interval,
            token_oracle=not args.no_token_oracle, backend=None if args.backend == "auto" else args.backend,
            enable_v_half=args.mha_v)
        cfg = K.CampaignConfig(engine=engine_cfg, model=model_cfg, num_requests=args.requests,
                               max_new_tokens=args.max_new_tokens, trials=args.trials,
                               detect_window=args.detect_window, seed=args.seed, prompt_path=args.prompts)
    except ValueError as e:
        raise UsageError(str(e)) from None

    bar = None
    state = {"label": ""}
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=1 + len(kinds) * args.trials, unit="episode", desc="canary-jax demo", file=sys.stderr,
                   dynamic_ncols=True, leave=False, disable=None)

    def on_episode(label: str) -> None:
        if bar is not None and state["label"]:
            bar.update(1)
        state["label"] = label

    def on_step(label: str, step: int) -> None:
        if bar is not None:
            bar.set_postfix_str(f"{label} step {step}", refresh=False)
            bar.refresh() if step % 8 == 0 else None

    t0 = time.perf_counter()
    try:
        camp = K.Campaign(cfg, kinds, on_step=on_step, on_episode=on_episode, dump_path=args.dump)
    except (E.ConfigError, PromptFileError) as e:
        if bar is not None:
            bar.close()
        raise UsageError(str(e)) from None
    result = camp.run()
    if bar is not None:
        bar.update(1)
        bar.close()
    summary = K.summarize(result)
    summary["wall_s"] = round(time.perf_counter() - t0, 2)
    if args.dump:
        summary["dump"] = dict(path=args.dump, episode=camp.dumped)
    if args.verbose:
        render.render_violation_samples(summary)
    render.render_text(summary)
    print(f"{summary['steps']} forward steps in {summary['wall_s']} s (incl. compile)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, default=str)
    if args.plot:
        render.plot(summary, args.plot)
    if args.dump:
        print(f"canary state of episode {camp.dumped} saved to {args.dump}" if camp.dumped
              else f"no episode detected a fault; nothing saved to {args.dump}")
    return EXIT_OK if summary["ok"] else EXIT_FAIL


# --- verify-dump -----------------------------------------------------------------------------------------
def _verify_dump(args) -> int:
    from canary_jax.demo import dump as D
    from canary_jax.demo import render

    _check_out_path("--json", args.json)
    try:
        rep = D.load_and_report(args.path, write_index=args.write_index, start=args.start)
    except D.DumpError as e:
        raise UsageError(str(e)) from None
    total = 0
    for ring in rep["rings"]:
        total += ring["decoded"]
        _print_ring(ring, args.max_messages, render)
    for buf in rep["buffers"]:
        cen = buf["census"]
        print(f"{buf['name']}: {buf['num_slots']} slots, {cen['records']} non-empty records, "
              f"{cen['broken_links']} records whose prev_hash matches no record at the previous position"
              + (" (stale records of freed slots also show up here)" if cen["broken_links"] else ""))
        if "verify" in buf:
            ring = buf["verify"]
            total += ring["decoded"]
            if not ring["real_kv_checked"]:
                print(f"  ({buf['name']}: real-KV fingerprints not checked: no k_buffer in the dump or a HEAD buffer)")
            _print_ring(ring, args.max_messages, render)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1, default=str)
    return EXIT_FAIL if total else EXIT_OK


def _print_ring(ring: dict, max_messages: int, render) -> None:
    print(f"{ring['name']}: {ring['write_index']} violations recorded, {ring['decoded']} decoded "
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
