"""``canary-jax`` command line: bad input is one line on stderr with exit status 2; verify-dump decodes
SGLang-layout rings and canary buffers."""

import io
import os
import subprocess
import sys

import numpy as np
import pytest

from canary_jax.cli import args as cli_args
from canary_jax.cli import main as cli
from canary_jax.cli import outputs, progress
from canary_jax.contract import constants, hashing


def _run(capsys, argv):
    rc = cli.main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["demo", "--inject", "kv_flip_lo,bogus"], "unknown fault kind 'bogus'"),
        (["demo", "--pool-pages", "8"], "(--pool-pages=8, page 0 is reserved)"),
        (["demo", "--pool-pages", "1"], "--pool-pages must be >= 2, got 1"),
        (["demo", "--max-context", "40"], "--max-context is 40"),
        (["demo", "--max-running", "100"], "--max-tokens-per-step (64) must be >= --max-running (100)"),
        (["demo", "--kv-heads", "3"], "--q-heads (4) must be a multiple of --kv-heads (3)"),
        (
            ["demo", "--head-dim", "4", "--inject", "kv_flip_lo,kv_flip_hi"],
            "--inject kv_flip_hi is impossible here: a slot's K row has only 16 bytes (--kv-heads 2 x --head-dim 4",
        ),
        (
            ["demo", "--seed", "99999999999999999999999"],
            "--seed must be between 0 and 4294967295, got 99999999999999999999999",
        ),
        (["demo", "--seed", "4294967296"], "--seed must be between 0 and 4294967295"),
        (
            ["demo", "--requests", "2", "--max-new-tokens", "2", "--trials", "1"],
            "the workload is too short for page_reuse, orphan_flip: in its 6 forward steps",
        ),
        (["demo", "--requests", "2", "--max-new-tokens", "2"], "raise --requests or --max-new-tokens"),
        (["demo", "--inject", ""], "--inject is empty"),
        (["demo", "--inject", " , "], "--inject is empty"),
        (["demo", "--json", "/proc/canary-x.json"], "--json '/proc/canary-x.json' is not writable"),
        (["demo", "--json", "/proc/version"], "--json '/proc/version' is not writable: a kernel pseudo-file"),
        (["demo", "--plot", "/proc/canary-x.png"], "--plot '/proc/canary-x.png' is not writable"),
        (["demo", "--dump", "/proc/canary-x.npz"], "--dump '/proc/canary-x.npz' is not writable"),
        (["verify-dump", "/nonexistent-dir/ring.npy", "--json", "/proc/canary-x.json"], "is not writable"),
        (["verify-dump", "/"], "/ is a directory, not a .npy/.npz file"),
        (["demo", "--trials", "0"], "--trials must be >= 1"),
        (["demo", "--page-size", "x"], "--page-size must be an integer"),
        (["demo", "--json", "/nonexistent-dir/out.json"], "does not exist"),
        (["demo", "--plot", "chart.jpg"], "must end in .png"),
        (["demo", "--prompts", "/nonexistent-dir/p.txt"], "file not found"),
        (["demo", "--real-kv", "some"], "invalid choice"),
        (["verify-dump", "/nonexistent-dir/ring.npy"], "dump file not found"),
        (["frobnicate"], "unknown command 'frobnicate'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    rc, out, err = _run(capsys, argv)
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("canary-jax: error: "), err
    assert needle in err
    assert "Traceback" not in err + out
    if needle.startswith("--"):  # argparse's "argument --x:" prefix is dropped when the message names the flag
        assert "argument --" not in err


def test_seed_range_edges_parse():
    p = cli_args.build_parser()
    assert p.parse_args(["demo", "--seed", "4294967295"]).seed == 4294967295
    assert p.parse_args(["demo", "--seed", "0"]).seed == 0


def test_flagify_names_flags_not_fields():
    assert (
        cli_args.flagify("max_tokens_per_step (8) must be >= max_running (10)")
        == "--max-tokens-per-step (8) must be >= --max-running (10)"
    )
    assert (
        cli_args.flagify("prompt 157 + max_new_tokens 16; num_pages=8")
        == "prompt 157 + --max-new-tokens 16; --pool-pages=8"
    )
    assert cli_args.flagify("my_num_pages and head_dims stay") == "my_num_pages and head_dims stay"


def test_output_probe_leaves_no_stray_file_and_keeps_existing_content(tmp_path):
    new = tmp_path / "new.json"
    outputs.check_out_path("--json", str(new))
    assert not new.exists()
    old = tmp_path / "old.json"
    old.write_text("keep me")
    outputs.check_out_path("--json", str(old))
    assert old.read_text() == "keep me"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_write_failure_at_write_time_is_one_line_exit_2(capsys, tmp_path):
    ring = np.zeros((2, 8), np.int64)
    ring[0] = [
        int(constants.CanaryLaunchTag.HEAD_K_FULL),
        3,
        1,
        5,
        5,
        0,
        0,
        int(constants.FailReason.VERIFY_POSITION_MISMATCH),
    ]
    p = tmp_path / "ring.npz"
    np.savez(p, ring=ring, write_index=np.array([1], np.int32))
    rc, out, err = _run(capsys, ["verify-dump", str(p), "--json", "/dev/full"])
    assert rc == 2
    assert "ring: 1 violations recorded, 1 decoded (ring capacity 2)" in out  # the report still printed
    assert err == "canary-jax: error: --json '/dev/full': cannot write: No space left on device\n"
    errors = []
    outputs.write_output("--plot", "/dev/full", lambda path: open(path, "w").write("x" * 70000), errors)
    assert errors == ["--plot '/dev/full': cannot write: No space left on device"]


def test_help_says_bare_runs_demo_and_lists_exit_codes(capsys):
    for argv, needles in (
        (["--help"], ["With no command, canary-jax runs the demo", "`canary-jax` is `canary-jax demo`"]),
        (
            ["demo", "--help"],
            [
                "exit status:",
                "2    bad input",
                "raise --requests / --max-new-tokens",
                "1    a fault that should be caught went undetected",
            ],
        ),
        (["verify-dump", "--help"], ["exit status:", "1    violations found", "0    no violations"]),
    ):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0
        out = capsys.readouterr().out
        for n in needles:
            assert n in out, (argv, n)


def test_prompt_file_without_prompts(capsys, tmp_path):
    p = tmp_path / "empty.txt"
    p.write_text("# nothing here\nsystem: only a preamble\n")
    rc, _, err = _run(capsys, ["demo", "--prompts", str(p)])
    assert rc == 2 and "holds no prompts" in err


def test_verify_dump_rejects_unrecognised_files(capsys, tmp_path):
    p = tmp_path / "x.npy"
    np.save(p, np.zeros((3, 5), np.float32))
    rc, _, err = _run(capsys, ["verify-dump", str(p)])
    assert rc == 2 and "holds no violation ring" in err
    q = tmp_path / "notes.txt"
    q.write_text("hello")
    rc, _, err = _run(capsys, ["verify-dump", str(q)])
    assert rc == 2 and "not a .npy or .npz file" in err


def test_verify_dump_sglang_int64_ring(capsys, tmp_path):
    ring = np.zeros((4, 8), np.int64)
    anchor = hashing.splitmix64_python(constants.CANARY_CHAIN_ANCHOR) - (1 << 64)
    ring[0] = [
        int(constants.CanaryLaunchTag.TAIL_K_FULL),
        17,
        5,
        42,
        -1,
        anchor,
        anchor,
        int(constants.FailReason.VERIFY_REAL_KV_HASH_MISMATCH),
    ]
    ring[1] = [
        int(constants.CanaryLaunchTag.HEAD_K_FULL),
        9,
        3,
        7,
        8,
        0,
        4,
        int(constants.FailReason.WRITE_TOKEN_MISMATCH | constants.FailReason.WRITE_POSITION_MISMATCH),
    ]
    p = tmp_path / "ring.npy"
    np.save(p, ring)
    rc, out, _ = _run(capsys, ["verify-dump", str(p)])
    assert rc == 1
    assert "ring: 2 violations recorded, 2 decoded (ring capacity 4)" in out
    assert (
        "kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash slot_idx=17 position=5 "
        "stored_token=42 expected_token=-1 stored_chain_hash=0xde7fae23a9a1b716 "
        "expected_aux=0xde7fae23a9a1b716"
    ) in out
    assert "launch_tag=HEAD_K_FULL fail_reason=write_token+write_position slot_idx=9" in out
    # An explicit write index and an npz with SGLang's key names.
    q = tmp_path / "state.npz"
    np.savez(q, violation_ring=ring, violation_write_index=np.array([1], np.int32))
    rc, out, _ = _run(capsys, ["verify-dump", str(q)])
    assert rc == 1 and "1 violations recorded, 1 decoded" in out


def test_verify_dump_without_write_index_infers_from_any_nonzero_column(capsys, tmp_path):
    ring = np.zeros((6, 8), np.int64)
    ring[0] = [int(constants.CanaryLaunchTag.TAIL_K_FULL), 17, 5, 42, -1, 1, 2, 0]  # fail bits 0, but a recorded row
    ring[1] = [99, 9, 3, 7, 8, 0, 4, int(constants.FailReason.VERIFY_POSITION_MISMATCH)]
    ring[2] = [int(constants.CanaryLaunchTag.HEAD_K_FULL), 9, 3, 7, 8, 0, 4, 2**40]
    p = tmp_path / "ring.npy"
    np.save(p, ring)
    rc, out, err = _run(capsys, ["verify-dump", str(p)])
    assert rc == 1
    assert "ring: 3 violations recorded, 3 decoded (ring capacity 6)" in out
    assert "canary-jax: warning: ring: the file holds no write index; assuming 3 violations" in err
    assert "launch_tag=unknown(99) fail_reason=verify_position slot_idx=9" in out
    assert "launch_tag=HEAD_K_FULL fail_reason=unknown(0x10000000000) slot_idx=9" in out
    assert "HEAD_K_FULL:unknown(0x10000000000)" in out  # the per-reason table
    # --start past the recorded rows warns and decodes nothing.
    rc, out, err = _run(capsys, ["verify-dump", str(p), "--start", "5"])
    assert rc == 0
    assert "3 violations recorded, 0 decoded from row 5" in out
    assert "--start 5 is at or past the 3 recorded violations; nothing to decode" in err
    # A saved write index wins over the inference, without a warning.
    q = tmp_path / "ring.npz"
    np.savez(q, ring=ring, write_index=np.array([1], np.int32))
    rc, out, err = _run(capsys, ["verify-dump", str(q)])
    assert rc == 1 and "1 violations recorded, 1 decoded" in out and err == ""


def test_verify_dump_empty_archive_and_directory(capsys, tmp_path):
    p = tmp_path / "empty.npz"
    np.savez(p)
    rc, _, err = _run(capsys, ["verify-dump", str(p)])
    assert rc == 2 and err.strip() == f"canary-jax: error: {p} is an empty .npz archive (no arrays); nothing to decode"
    rc, _, err = _run(capsys, ["verify-dump", str(tmp_path)])
    assert rc == 2 and err.strip() == f"canary-jax: error: {tmp_path} is a directory, not a .npy/.npz file"


def test_verify_dump_clean_canary_buffer(capsys, tmp_path):
    # Two chained records at slots 1 and 2 (positions 0, 1): the census finds no broken link.
    anchor = hashing.splitmix64_python(constants.CANARY_CHAIN_ANCHOR)
    buf = np.zeros((4, 32), np.uint8)
    rec = buf.view("<i8").reshape(4, 4)
    rec[1] = [101, 0, np.int64(anchor - (1 << 64)), 0]
    m = hashing.splitmix64_python(hashing.splitmix64_python(hashing.splitmix64_python(anchor) ^ 101) ^ 0)
    rec[2] = [202, 1, np.uint64(m).astype(np.int64), 0]
    p = tmp_path / "buf.npy"
    np.save(p, buf)
    rc, out, _ = _run(capsys, ["verify-dump", str(p)])
    assert rc == 0, out
    assert "2 non-empty records, 0 records whose prev_hash matches no record" in out
    rec[2, 2] ^= 1
    np.save(p, buf)
    rc, out, _ = _run(capsys, ["verify-dump", str(p)])
    assert "1 records whose prev_hash matches no record" in out


def test_module_entry_point_bad_kind_no_traceback():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "canary_jax", "demo", "--inject", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("canary-jax: error: unknown fault kind 'nope'")
    assert "Traceback" not in proc.stderr


def test_cli_main_runs_with_python_m():
    # a new user's `python -m canary_jax.cli.main --help` printed nothing: the module had no __main__ guard
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", "canary_jax.cli.main", "--help"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: canary-jax [-h] {demo,verify-dump}")


def test_plot_without_matplotlib_is_one_line_exit_2(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    rc, out, err = _run(capsys, ["demo", "--plot", str(tmp_path / "chart.png")])
    assert rc == 2 and out == ""
    assert err == (
        "canary-jax: error: --plot needs matplotlib, which is not installed: pip install 'canary-jax[demo]'\n"
    )
    assert not (tmp_path / "chart.png").exists()


def test_bad_backend_in_environment_is_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.setenv("CANARY_JAX_BACKEND", "foo")  # the default --backend auto reads it
    rc, out, err = _run(capsys, ["demo", "--requests", "2"])
    assert rc == 2 and out == ""
    assert err == (
        "canary-jax: error: $CANARY_JAX_BACKEND='foo': backend must be one of ('reference', 'pallas', 'pallas_tpu')\n"
    )
    rc, _, err = _run(capsys, ["demo", "--backend", "reference", "--requests", "2", "--max-new-tokens", "2"])
    assert rc == 2 and "$CANARY_JAX_BACKEND" not in err  # an explicit --backend does not read it


def test_progress_without_tqdm_is_a_no_op_with_one_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    err = io.StringIO()
    bar = progress.open_progress(3, err=err)
    bar.on_episode("clean")
    bar.on_step("clean", 8)
    bar.close()
    assert err.getvalue() == (
        "canary-jax: no progress bar: tqdm is not installed (pip install 'canary-jax[demo]' gives one)\n"
    )
    quiet = io.StringIO()
    progress.open_progress(3, enabled=False, err=quiet).close()  # --no-progress: tqdm is not even imported
    assert quiet.getvalue() == ""


def test_layers_runtime_imports_no_tool_kernel_or_bridge():
    """contract <- runtime <- cli: importing the runtime loads no CLI module, Pallas kernel, bridge or demo
    dependency, and the CLI loads tqdm / matplotlib only when a run asks for them."""
    code = (
        "import sys\n"
        "import canary_jax.runtime.endpoints, canary_jax.runtime.groups, canary_jax.runtime.report\n"
        "import canary_jax.runtime.state, canary_jax.runtime.step, canary_jax.runtime.sweep\n"
        "bad = lambda: sorted(m for m in sys.modules if m.split('.')[0] in "
        "('pallas_kernels', 'interop', 'torch', 'tqdm', 'matplotlib'))\n"
        "assert not bad() and not [m for m in sys.modules if m.startswith('canary_jax.cli')], bad()\n"
        "import canary_jax.cli.main, canary_jax.cli.demo.campaign, canary_jax.cli.demo.summary\n"
        "import canary_jax.cli.render, canary_jax.cli.verify_dump, canary_jax.cli.progress\n"
        "assert not bad(), bad()\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr


def _big_ring_file(tmp_path, rows=4000):
    """An SGLang ``int64[rows, 8]`` ring, every row a recorded violation: far more report text than a pipe holds."""
    ring = np.zeros((rows, 8), np.int64)
    ring[:, 0] = int(constants.CanaryLaunchTag.TAIL_K_FULL)
    ring[:, 1] = np.arange(1, rows + 1)
    ring[:, 7] = int(constants.FailReason.VERIFY_POSITION_MISMATCH)
    p = tmp_path / "big_ring.npz"
    np.savez(p, ring=ring, write_index=np.array([rows], np.int32))
    return p


def test_verify_dump_into_closed_pipe_exits_141_without_traceback(tmp_path):
    # `canary-jax verify-dump FILE | head -1`: the reader takes one line and goes away.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    argv = [sys.executable, "-m", "canary_jax", "verify-dump", str(_big_ring_file(tmp_path)), "--max-messages", "4000"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=120)
    assert first.startswith(b"ring: 4000 violations recorded, 4000 decoded")
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err
    assert err == ""
    assert rc == cli_args.EXIT_BROKEN_PIPE == 141


class _ClosedPipe(io.StringIO):
    """A stdout whose reader went away: every write raises BrokenPipeError (and it has no file descriptor)."""

    def write(self, s):
        raise BrokenPipeError(32, "Broken pipe")


def test_demo_output_into_closed_pipe_exits_141(monkeypatch, capsys):
    # The demo's printed report goes through the same boundary as verify-dump's (the demo itself is stubbed:
    # it runs for seconds; what is pinned here is main's handling of its prints).
    def fake_demo(args):
        for i in range(10):
            print(f"report line {i}")
        return cli_args.EXIT_OK

    monkeypatch.setattr(cli, "_demo", fake_demo)
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert cli.main(["demo", "--inject", "none"]) == 141
    assert capsys.readouterr().err == ""
