"""``canary-jax`` command line: bad input is one line on stderr with exit status 2; verify-dump decodes
SGLang-layout rings and canary buffers."""

import os
import subprocess
import sys

import numpy as np
import pytest

from canary_jax import constants as C
from canary_jax import hashing as H
from canary_jax.demo import cli


def _run(capsys, argv):
    rc = cli.main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["demo", "--inject", "kv_flip_lo,bogus"], "unknown fault kind 'bogus'"),
        (["demo", "--pool-pages", "8"], "pool too small"),
        (["demo", "--max-context", "40"], "max_context is 40"),
        (["demo", "--max-running", "100"], "max_running"),
        (["demo", "--kv-heads", "3"], "multiple of num_kv_heads"),
        (["demo", "--trials", "0"], "--trials must be >= 1"),
        (["demo", "--page-size", "x"], "--page-size must be an integer"),
        (["demo", "--json", "/nonexistent-dir/out.json"], "does not exist"),
        (["demo", "--plot", "/tmp/chart.jpg"], "must end in .png"),
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
    anchor = H.splitmix64_python(C.CANARY_CHAIN_ANCHOR) - (1 << 64)
    ring[0] = [int(C.CanaryLaunchTag.TAIL_K_FULL), 17, 5, 42, -1, anchor, anchor,
               int(C.FailReason.VERIFY_REAL_KV_HASH_MISMATCH)]
    ring[1] = [int(C.CanaryLaunchTag.HEAD_K_FULL), 9, 3, 7, 8, 0, 4,
               int(C.FailReason.WRITE_TOKEN_MISMATCH | C.FailReason.WRITE_POSITION_MISMATCH)]
    p = tmp_path / "ring.npy"
    np.save(p, ring)
    rc, out, _ = _run(capsys, ["verify-dump", str(p)])
    assert rc == 1
    assert "ring: 2 violations recorded, 2 decoded (ring capacity 4)" in out
    assert ("kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash slot_idx=17 position=5 "
            "stored_token=42 expected_token=-1 stored_chain_hash=0xde7fae23a9a1b716 "
            "expected_aux=0xde7fae23a9a1b716") in out
    assert "launch_tag=HEAD_K_FULL fail_reason=write_token+write_position slot_idx=9" in out
    # An explicit write index and an npz with SGLang's key names.
    q = tmp_path / "state.npz"
    np.savez(q, violation_ring=ring, violation_write_index=np.array([1], np.int32))
    rc, out, _ = _run(capsys, ["verify-dump", str(q)])
    assert rc == 1 and "1 violations recorded, 1 decoded" in out


def test_verify_dump_clean_canary_buffer(capsys, tmp_path):
    # Two chained records at slots 1 and 2 (positions 0, 1): the census finds no broken link.
    anchor = H.splitmix64_python(C.CANARY_CHAIN_ANCHOR)
    buf = np.zeros((4, 32), np.uint8)
    rec = buf.view("<i8").reshape(4, 4)
    rec[1] = [101, 0, np.int64(anchor - (1 << 64)), 0]
    m = H.splitmix64_python(H.splitmix64_python(H.splitmix64_python(anchor) ^ 101) ^ 0)
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
    proc = subprocess.run([sys.executable, "-m", "canary_jax", "demo", "--inject", "nope"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("canary-jax: error: unknown fault kind 'nope'")
    assert "Traceback" not in proc.stderr
