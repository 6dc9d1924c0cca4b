"""The ``canary-jax`` command line's parser, exit codes and input errors.

:func:`build_parser` builds the ``demo`` and ``verify-dump`` sub-commands. Bad input raises
:class:`UsageError`, which :func:`canary_jax.cli.main.main` prints as one line on stderr
(``canary-jax: error: ...``) with exit status 2 (``EXIT_USAGE``), never a traceback. The exit codes of each
command are listed in ``DEMO_EXIT_CODES`` / ``VERIFY_EXIT_CODES`` (printed by ``--help``).
"""

from __future__ import annotations

import argparse
import re

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
# The reader of stdout went away (``| head``): 128 + SIGPIPE (13), the status a shell reports for a tool that
# SIGPIPE ended, so pipelines (``set -o pipefail``) see the same as with POSIX tools. Nothing on stderr.
EXIT_BROKEN_PIPE = 141

# What installs the demo's optional dependencies (tqdm for the progress bar, matplotlib for --plot).
DEMO_EXTRA_HINT = "pip install 'canary-jax[demo]'"

DEMO_EXIT_CODES = """\
exit status:
  0    every fault the configuration should catch was caught (expected misses and kinds not
       applicable to the model are reported, not failed), and no false positives
  1    a fault that should be caught went undetected, a fault could not be injected, a false
       positive, or a canary health-check error
  2    bad input, as one line on stderr: unknown fault kind, impossible sizes, a workload too short
       for the requested faults (raise --requests / --max-new-tokens), unwritable --json/--plot/--dump,
       --plot without matplotlib (pip install 'canary-jax[demo]')
  130  interrupted
  141  stdout closed early (e.g. piped into head); the rest of the output is dropped"""

VERIFY_EXIT_CODES = """\
exit status:
  0    no violations (none recorded in the ring, none found re-verifying a canary buffer)
  1    violations found
  2    bad input, as one line on stderr: missing, unreadable or unrecognised file, unwritable --json
  141  stdout closed early (e.g. piped into head); the rest of the output is dropped"""

# Config field names in ConfigError / ValueError messages -> the flags that set them.
_FIELD_FLAGS = {
    "num_pages": "--pool-pages",
    "page_size": "--page-size",
    "max_running": "--max-running",
    "max_tokens_per_step": "--max-tokens-per-step",
    "chunk_size": "--chunk-size",
    "max_context": "--max-context",
    "sweep_interval": "--sweep-interval",
    "num_requests": "--requests",
    "max_new_tokens": "--max-new-tokens",
    "detect_window": "--detect-window",
    "num_layers": "--layers",
    "d_model": "--d-model",
    "num_q_heads": "--q-heads",
    "num_kv_heads": "--kv-heads",
    "head_dim": "--head-dim",
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
    p = _Parser(
        prog="canary-jax",
        formatter_class=raw,
        description="KV-cache canary for JAX: serving demo with fault injection, and a decoder for saved canary state.",
        epilog="With no command, canary-jax runs the demo: `canary-jax` is `canary-jax demo`, and\n"
        "`canary-jax --trials 1` is `canary-jax demo --trials 1`.\n"
        "`canary-jax demo --help` and `canary-jax verify-dump --help` list each command's flags\n"
        "and exit codes.",
    )
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="{demo,verify-dump}")
    d = sub.add_parser(
        "demo",
        help="(the default) serve a batch of requests under the canary and run a fault campaign",
        formatter_class=raw,
        epilog=DEMO_EXIT_CODES,
        description="Serve real text prompts with a small paged-KV transformer under the KV canary,\n"
        "inject faults, report detection. Defaults run every fault kind. This is also\n"
        "what a bare `canary-jax [flags]` runs.",
    )
    g = d.add_argument_group("faults")
    g.add_argument(
        "--inject",
        default="all",
        metavar="KIND[,KIND...]",
        help=f"fault kinds to inject: all (default), none, or a comma list of {', '.join(FAULT_KINDS)}",
    )
    g.add_argument("--trials", type=_positive("--trials"), default=3, help="episodes per fault kind (default 3)")
    g.add_argument(
        "--detect-window",
        type=_positive("--detect-window"),
        default=24,
        help="steps after an injection before the fault counts as missed (default 24)",
    )
    c = d.add_argument_group("canary")
    c.add_argument(
        "--real-kv",
        "--real-kv-mode",
        dest="real_kv",
        choices=("none", "partial", "all"),
        default="all",
        help="real-KV fingerprint of layer 0's K pool: none, partial (first 16 bytes) or all (default)",
    )
    c.add_argument(
        "--sweep-interval",
        type=_nonneg("--sweep-interval"),
        default=4,
        help="steps between sweeps of the prefix cache, 0 = off (default 4)",
    )
    c.add_argument(
        "--no-token-oracle",
        action="store_true",
        help="turn off the write-input and verify-token asserts (token swaps then go unseen)",
    )
    c.add_argument(
        "--mha-v",
        action="store_true",
        help="also run the V-half endpoints (SGLang's SGLANG_KV_CANARY_ENABLE_MHA_V; default K only)",
    )
    c.add_argument(
        "--backend",
        choices=("auto", "reference", "pallas", "pallas_tpu"),
        default="auto",
        help="canary kernels: auto (Pallas GPU kernels on a GPU, Pallas TPU verify on a TPU, jnp reference "
        "elsewhere), reference, pallas, pallas_tpu",
    )
    s = d.add_argument_group("serving")
    s.add_argument("--requests", type=_positive("--requests"), default=24, help="requests to serve (default 24)")
    s.add_argument(
        "--max-new-tokens",
        type=_positive("--max-new-tokens"),
        default=16,
        help="tokens generated per request (default 16)",
    )
    s.add_argument("--page-size", type=_positive("--page-size"), default=4, help="KV slots per page (default 4)")
    s.add_argument(
        "--pool-pages",
        type=_int_at_least("--pool-pages", 2),
        default=256,
        help="pages in the KV pool incl. the reserved page 0 (default 256)",
    )
    s.add_argument(
        "--max-running", type=_positive("--max-running"), default=8, help="concurrent requests / batch rows (default 8)"
    )
    s.add_argument(
        "--max-tokens-per-step",
        type=_positive("--max-tokens-per-step"),
        default=64,
        help="token capacity of one forward (default 64)",
    )
    s.add_argument(
        "--chunk-size",
        type=_positive("--chunk-size"),
        default=32,
        help="longest prefill chunk per request per step (default 32)",
    )
    s.add_argument(
        "--max-context",
        type=_int_at_least("--max-context", 2),
        default=192,
        help="req_to_token width: prompt + new tokens must fit (default 192)",
    )
    s.add_argument("--prompts", metavar="PATH", default=None, help="prompt file (default: the packaged prompts)")
    m = d.add_argument_group("model")
    m.add_argument("--layers", type=_positive("--layers"), default=2)
    m.add_argument("--d-model", type=_positive("--d-model"), default=64)
    m.add_argument("--q-heads", type=_positive("--q-heads"), default=4)
    m.add_argument("--kv-heads", type=_positive("--kv-heads"), default=2)
    m.add_argument("--head-dim", type=_positive("--head-dim"), default=32)
    o = d.add_argument_group("output")
    o.add_argument(
        "--seed",
        type=_int_at_least("--seed", 0, MAX_SEED),
        default=0,
        help=f"weights, workload and injection seed, 0..{MAX_SEED} (default 0)",
    )
    o.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    o.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG chart of detection per fault kind (needs matplotlib: the demo extra)",
    )
    o.add_argument(
        "--dump",
        metavar="PATH",
        help="save the canary state (.npz) of the first episode that detected a fault, for verify-dump",
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bar (the bar needs tqdm: the demo extra)")
    d.add_argument(
        "--devices",
        type=_positive("--devices"),
        default=None,
        metavar="N",
        help="shard the KV pools and the canary over N devices by KV heads, one canary per head shard, the shard "
        "named in the report (on a CPU: N forced host devices)",
    )
    o.add_argument(
        "-v", "--verbose", action="store_true", help="also print each episode's first violation in SGLang's report text"
    )

    v = sub.add_parser(
        "verify-dump",
        help="decode a saved violation ring / canary buffer (.npy or .npz)",
        formatter_class=raw,
        epilog=VERIFY_EXIT_CODES,
        description="Decode a violation ring (int64[R,8] or uint32[R,8,2]) or canary buffers\n"
        "(uint8[N,>=32]) saved from a live server into the violation report.",
    )
    v.add_argument("path", help=".npy or .npz file")
    v.add_argument(
        "--write-index",
        type=_nonneg("--write-index"),
        default=None,
        help="violations recorded (default: the file's write index; without one, the rows up to the "
        "last non-zero ring row, with a warning)",
    )
    v.add_argument("--start", type=_nonneg("--start"), default=0, help="first ring row to report")
    v.add_argument("--json", metavar="PATH", help="write the decoded report as JSON")
    v.add_argument(
        "--max-messages",
        type=_nonneg("--max-messages"),
        default=20,
        help="formatted violation messages to print per ring (default 20)",
    )
    return p
