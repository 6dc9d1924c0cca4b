"""The canary on a device mesh (:mod:`canary_jax.runtime.sharded`), on 4 forced CPU devices in a subprocess
(``tests/helpers/sharded_child.py``) so that the rest of the suite keeps one device.

The child runs a small serving workload on a 2x2 (dp, tp) mesh (requests over dp, KV heads over tp) and the
same workload on the single-device canary once per shard (that shard's requests, its heads). Asserted here:
byte parity of every shard's canary buffers, ring, counters and KV with its single-device run; no collective
in the compiled step, HEAD/TAIL and sweep programs (and a pool-sharded plain ``jit`` as the control that has
them); one report naming each violation's shard; the head-shard consistency check; stats per shard and total.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import unittest

import numpy as np

from canary_jax.cli.demo.faults import FAULT_KINDS
from canary_jax.runtime import sharded
from canary_jax.runtime.state import CanaryStepConfig
from helpers.child_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARDS = [(d, t) for d in range(2) for t in range(2)]
TOKEN_FIELDS = slice(0, 24)  # token, position, prev_hash (int64 each) of a 32-byte canary record
REAL_KV_FIELD = slice(24, 32)


def run_child(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = child_env()
    return subprocess.run(
        [sys.executable, "-m", "tests.helpers.sharded_child", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class MeshTest(unittest.TestCase):
    X64 = False

    @classmethod
    def setUpClass(cls):
        cls._tmp = tempfile.TemporaryDirectory()
        out = os.path.join(cls._tmp.name, "mesh.npz")
        proc = run_child(["mesh", out] + (["--x64"] if cls.X64 else []))
        if proc.returncode != 0:
            raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
        z = np.load(out)
        cls.arrays = {k: z[k] for k in z.files if k != "json"}
        cls.result = json.loads(str(z["json"]))

    @classmethod
    def tearDownClass(cls):
        cls._tmp.cleanup()

    def test_x64_mode(self):
        self.assertEqual(self.result["x64"], self.X64)

    def test_byte_parity_per_shard_with_the_single_device_canary(self):
        names = ("k_head", "k_tail", "ring", "write_index", "slot_run_counters", "kernel_run_counters", "pool")
        for name in names:
            for d, t in SHARDS:
                a = self.arrays[f"sharded_{name}_{d}{t}"]
                b = self.arrays[f"single_{name}_{d}{t}"]
                self.assertEqual(a.shape, b.shape, (name, d, t))
                np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=f"{name} shard {(d, t)}")
        # the runs did something: every shard wrote records and counted entries
        for d, t in SHARDS:
            self.assertGreater(int(self.arrays[f"sharded_k_tail_{d}{t}"].any(axis=1).sum()), 10)
            self.assertGreater(int(self.arrays[f"sharded_slot_run_counters_{d}{t}"][:, 0].sum()), 0)

    def test_head_shards_share_bookkeeping_and_differ_in_real_kv_hash(self):
        for d in range(2):
            a, b = self.arrays[f"sharded_k_head_{d}0"], self.arrays[f"sharded_k_head_{d}1"]
            np.testing.assert_array_equal(a, b)  # HEAD records carry no real-KV hash
            a, b = self.arrays[f"sharded_k_tail_{d}0"], self.arrays[f"sharded_k_tail_{d}1"]
            written = a.any(axis=1)
            if d == 1:
                np.testing.assert_array_equal(a[:, TOKEN_FIELDS], b[:, TOKEN_FIELDS])
            else:  # shard (0, 1)'s token flip at the injected slot is the only difference
                _, _, slot = self.result["token_fault"]
                diff = np.nonzero((a[:, TOKEN_FIELDS] != b[:, TOKEN_FIELDS]).any(axis=1))[0].tolist()
                self.assertEqual(diff, [slot])
            # each head shard fingerprints its own heads: the real-KV hashes differ on every written slot
            differ = (a[:, REAL_KV_FIELD] != b[:, REAL_KV_FIELD]).any(axis=1)
            np.testing.assert_array_equal(differ[written], True)

    def test_no_collective_in_the_shard_map_programs(self):
        self.assertEqual(self.result["hlo_step"], [])
        self.assertEqual(self.result["hlo_head_tail"], [])
        self.assertEqual(self.result["hlo_sweep"], [])
        # the consistency check gathers two uint32 words per head shard, nothing pool- or canary-sized
        self.assertEqual(self.result["hlo_consistency"], [["all-gather", "u32[2,2]{1,0}"]])
        # control: the single-device step under a plain jit on a head-sharded pool does move data
        self.assertTrue(self.result["hlo_plain_jit"], "the control should show XLA's collectives")

    def test_one_report_with_shards(self):
        msgs = self.result["messages"]
        recs = self.result["records"]
        self.assertEqual(len(msgs), 3)
        self.assertEqual(len(recs), 3)
        d, t, kv_slot = self.result["kv_fault"]
        td, tt, tok_slot = self.result["token_fault"]
        got = [(tuple(r["shard"]), r["tag"], r["slot_idx"], r["reasons"]) for r in recs]
        self.assertEqual(
            got,
            [
                ((d, t), "SWEEP_K_FULL", kv_slot, ["verify_real_kv_hash"]),
                ((td, tt), "TAIL_K_FULL", tok_slot + 1, ["verify_chain_hash"]),
                ((d, t), "TAIL_K_FULL", kv_slot, ["verify_real_kv_hash"]),
            ],
        )
        for m, r in zip(msgs, recs):
            s = tuple(r["shard"])
            self.assertTrue(m.endswith(f" shard=({s[0]},{s[1]})"), m)
            self.assertTrue(m.startswith(f"kv_canary violation: launch_tag={r['tag']} "), m)
        # SGLang's text is the prefix: equal, line for line, to the single-device report of that shard
        for s in {(d, t), (td, tt)}:
            single = self.result["single_messages"][f"{s[0]},{s[1]}"]
            mine = [m for m, r in zip(msgs, recs) if tuple(r["shard"]) == s]
            self.assertEqual(len(single), len(mine))
            for a, b in zip(mine, single):
                self.assertEqual(a.splitlines()[:-1], b.splitlines()[:-1])
                self.assertRegex(
                    a.splitlines()[-1], r"^  total_violations=\d+ ring_overflow=False step_when_pumped=\d+ shard="
                )
        for s in SHARDS:
            if s not in {(d, t), (td, tt)}:
                self.assertEqual(self.result["single_messages"][f"{s[0]},{s[1]}"], [])

    def test_consistency_flags_the_disagreeing_head_shards(self):
        self.assertEqual(self.result["consistency_clean"], [[0, 0], [0, 0]])
        self.assertEqual(self.result["consistency_fault"], [[1, 1], [0, 0]])
        self.assertEqual(len(self.result["disagreement"]), 2)
        for t, m in enumerate(self.result["disagreement"]):
            self.assertRegex(m, rf"^kv_canary shard disagreement: .* dp row 0 step=\d+ shard=\(0,{t}\)$")

    def test_stats_per_shard_and_total(self):
        lines = self.result["stats_lines"]
        self.assertEqual(len(lines), 5)
        viol, prot = [], []
        for (d, t), line in zip(SHARDS, lines):
            m = re.match(
                r"^\[canary\] step=\d+ protected_tokens=(\d+) sweep_passes=2 violations=(\d+) .* shard=\((\d),(\d)\)$",
                line,
            )
            self.assertIsNotNone(m, line)
            self.assertEqual((int(m.group(3)), int(m.group(4))), (d, t))
            self.assertEqual(int(m.group(2)), int(self.arrays[f"single_write_index_{d}{t}"][0]))
            slot_runs = self.arrays[f"single_slot_run_counters_{d}{t}"].astype(np.uint64)
            self.assertEqual(int(m.group(1)), int((slot_runs[:, 0] + (slot_runs[:, 1] << np.uint64(32))).sum()))
            viol.append(int(m.group(2)))
            prot.append(int(m.group(1)))
        self.assertEqual(viol, [0, 1, 2, 0])
        self.assertIn(f"protected_tokens={sum(prot)} sweep_passes=2 violations=3 ", lines[-1])
        self.assertTrue(lines[-1].endswith(" shards=4"))


class MeshX64Test(MeshTest):
    X64 = True


class RefusalsTest(unittest.TestCase):
    """Issue #14: clear refusals, before any shard_map error and before anything runs (4 forced devices)."""

    @classmethod
    def setUpClass(cls):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "errors.npz")
            proc = run_child(["errors", out])
            if proc.returncode != 0:
                raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
            cls.r = json.loads(str(np.load(out)["json"]))

    def assertRefused(self, name, kind, pattern):
        got = self.r[name]
        self.assertIsNotNone(got, f"{name} was not refused")
        self.assertEqual(got[0], kind, got)
        self.assertRegex(got[1], pattern)

    def test_mis_sharded_pool_is_refused_and_state_kept(self):
        for name, spec in (
            ("replicated", r"P\(\)"),
            ("transposed", r"P\('tp', None, 'dp', None\)"),
            ("slots_over_tp", r"P\('dp', 'tp', None, None\)"),
        ):
            for who in ("tail", "step", "sweep"):
                self.assertRefused(
                    f"{who}_{name}",
                    "ValueError",
                    rf"^kv-canary: ShardedCanary\.{who}: kv_state is sharded NamedSharding\(.*spec={spec}.*not as "
                    r"kv_specs says \(P\('dp', None, 'tp', None\)",
                )
            self.assertTrue(self.r[f"pool_alive_{name}"])  # step donates the pool: refused before donation
        self.assertRefused("tail_tree", "ValueError", r"kv_state\['k'\] is sharded SingleDeviceSharding")
        self.assertTrue(self.r["state_unchanged"])
        self.assertTrue(self.r["good_ran"])

    def test_state_batch_and_num_tokens(self):
        for who in ("head", "plan", "consistency"):
            self.assertRefused(
                f"{who}_unsharded_state",
                "ValueError",
                rf"ShardedCanary\.{who}: state is not sharded .*layout\.shard_state",
            )
        self.assertRefused(
            "head_other_layout", "ValueError", r"state is sharded for another layout .*\(2, 2\); .*dp=4 x tp=1"
        )
        self.assertRefused("head_unsharded_batch", "ValueError", r"batch is not sharded .*layout\.shard_batch")
        self.assertRefused("head_num_tokens_list", "TypeError", r"num_tokens must be an int32\[2\] array.*got list")
        for name, got in (("len3", "int32\\[3\\]"), ("scalar", "int32\\[\\]"), ("float", "float32\\[2\\]")):
            self.assertRefused(
                f"head_num_tokens_{name}", "ValueError", rf"num_tokens must be an int32\[2\] array.*got {got}$"
            )

    def test_none_for_a_held_shard_and_no_kv(self):
        for who in ("shard_batch", "shard_per_dp"):
            self.assertRefused(
                f"{who}_none_held", "ValueError", rf"{who}: dp shard 1 is held by this process; got None"
            )
        for who in ("sweep", "tail"):
            self.assertRefused(
                f"{who}_kv_none", "ValueError", rf"real_kv_hash_mode=ALL .* ShardedCanary\.{who} got no real_kv_sources"
            )
        self.assertRefused(
            "sweep_unsharded_plan",
            "ValueError",
            r"ShardedCanary\.sweep: sweep_plans\[0\] must be laid out per dp shard .*from layout\.shard_per_dp\), "
            r"got \(\d+, 2\)$",
        )


class LayoutErrorsTest(unittest.TestCase):
    """Static refusals, on this process's one device."""

    def test_layout(self):
        import jax
        from jax.sharding import Mesh

        with self.assertRaisesRegex(ValueError, r"a 2x2 mesh needs 4 devices, got 1"):
            sharded.ShardLayout.create(dp=2, tp=2)
        with self.assertRaisesRegex(ValueError, r"dp and tp must be positive, got dp=0 tp=1"):
            sharded.ShardLayout.create(dp=0, tp=1)
        with self.assertRaisesRegex(ValueError, r"axis names must be \('dp', 'tp'\), got \('x', 'y'\)"):
            sharded.ShardLayout(mesh=Mesh(np.array(jax.devices()).reshape(1, 1), ("x", "y")))
        with self.assertRaisesRegex(TypeError, r"must be a jax.sharding.Mesh, got str"):
            sharded.ShardLayout(mesh="mesh")

    def test_shard_batch_counts(self):
        lay = sharded.ShardLayout.create(dp=1, tp=1)
        cfg = CanaryStepConfig(verify_capacity=8, write_req_capacity=2)
        with self.assertRaisesRegex(ValueError, r"needs 1 batches \(one per dp shard\), got 2"):
            lay.shard_batch([None, None], cfg)
        with self.assertRaisesRegex(ValueError, r"shard_batch got no batch"):
            lay.shard_batch([None], cfg)
        with self.assertRaisesRegex(TypeError, r"layout must be a ShardLayout, got int"):
            sharded.ShardedCanary(1, cfg)

    def test_shard_batch_checks_host_values_as_the_step_api(self):
        from canary_jax.runtime import CanaryBatch, CanaryBufferGroup, CanaryState, PoolKind, canary_plan

        lay = sharded.ShardLayout.create(dp=1, tp=1)
        cfg = CanaryStepConfig(verify_capacity=8, write_req_capacity=2)
        group = CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=16, has_v_half=False)
        state = CanaryState.create([group], ring_capacity=4)
        r2t = np.zeros((4, 8), np.int32)

        def batch(rpi, loc):
            return CanaryBatch(
                req_pool_indices=np.array(rpi),
                prefix_lens=np.array([0, 0]),
                extend_seq_lens=np.array([1, 0]),
                input_ids=np.array([7]),
                positions=np.array([0]),
                out_cache_loc=np.array([loc]),
                req_to_token=r2t,
            )

        cases = (  # the single-device step API's refusal of each, word for word
            (batch([-3, 0], 1), r"req_pool_indices\[0\] = -3 is negative"),
            (batch([9, 0], 1), r"req_pool_indices\[0\] = 9 is outside req_to_token's 4 rows"),
            (batch([1, 0], 99), r"out_cache_loc\[0\] = 99 is outside \[0, 16\)"),
        )
        for b, msg in cases:
            with self.assertRaisesRegex(ValueError, msg):
                canary_plan(state, b, config=cfg)
            with self.assertRaisesRegex(ValueError, msg):
                lay.shard_batch([b], cfg, state=state)
        lay.shard_batch([cases[2][0]], cfg)  # out_cache_loc's bound needs the state: without it, not checked
        sb, n = lay.shard_batch([batch([1, 0], 15)], cfg, state=state)
        self.assertEqual(np.asarray(n).tolist(), [1])

    def test_health_checker_refuses_delayed(self):
        with self.assertRaisesRegex(ValueError, r"ShardedHealthChecker does not support delayed=True"):
            sharded.ShardedHealthChecker([0], delayed=True)
        sharded.ShardedHealthChecker([0], delayed=False)

    def test_health_checker_refuses_a_shard_whose_launch_ticket_is_not_zero(self):
        import dataclasses

        import jax
        import jax.numpy as jnp

        import canary_jax

        log = jax.tree_util.tree_map(lambda x: x[None, None], canary_jax.ViolationLog.allocate(ring_capacity=4))
        hc = sharded.ShardedHealthChecker([0], every_n_steps=1, warmup_steps=0)
        bad = dataclasses.replace(log, launch_ticket=jnp.array([[[2]]], jnp.int32))
        with self.assertRaisesRegex(
            RuntimeError, r"^kv-canary: launch_ticket is 2 between launches at step=1 .* shard=\(0,0\)$"
        ):
            hc.step(bad, step=1)


class DemoDevicesTest(unittest.TestCase):
    """``canary-jax demo --devices 4`` on forced CPU devices: the campaign passes and names each shard."""

    def test_demo_devices_4(self):
        env = child_env()
        proc = subprocess.run(
            [sys.executable, "-m", "canary_jax", "demo", "--devices", "4", "--trials", "1", "--no-progress"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        self.assertEqual(proc.returncode, 0, proc.stdout[-4000:] + proc.stderr[-4000:])
        self.assertIn("OK: every fault the configuration should catch was caught, no false positives", proc.stdout)
        self.assertIn("--devices 4: using --kv-heads 4 --q-heads 4", proc.stderr)
        lines = [ln for ln in proc.stdout.splitlines() if re.match(r"^  \w+#0: ", ln)]
        kinds = {ln.split("#")[0].strip() for ln in lines}
        self.assertEqual(kinds, set(FAULT_KINDS))
        for ln in lines:
            self.assertRegex(ln, r" shard=\(0,[0-3]\)$")
        # a canary-record flip is injected into head shard 3 only: that shard reports it
        corrupt = [ln for ln in lines if ln.lstrip().startswith("canary_corrupt#")]
        self.assertTrue(corrupt[0].endswith(" shard=(0,3)"), corrupt)

    def test_demo_pools_are_head_sharded(self):
        """The demo engine's K/V pools live head-sharded on the 4 devices, the model's forward keeps them so
        (compiled once, only its [tokens, d_model] all-reduces), and no step moves the pool with a device_put."""
        env = child_env()
        proc = subprocess.run(
            [sys.executable, "-c", _POOL_CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
        self.assertEqual(proc.returncode, 0, proc.stdout[-4000:] + proc.stderr[-4000:])
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        layers, pages, page_size, heads, head_dim = r["shape"]
        self.assertEqual(heads, 4)
        for name in ("k", "v"):
            self.assertEqual(r[f"{name}_devices"], 4)
            self.assertEqual(r[f"{name}_spec"], [None, None, None, "tp", None])
            # each device holds one head (heads / N) of every layer, page and slot
            self.assertEqual(r[f"{name}_local"], [[layers, pages, page_size, 1, head_dim]] * 4)
        self.assertGreaterEqual(r["steps"], 10)
        self.assertGreaterEqual(r["sweeps"], 2)
        self.assertEqual(r["violations_clean"], 0)
        self.assertGreater(r["violations_after_flip"], 0)
        pool_elems = pages * page_size * heads * head_dim  # one layer of one pool
        big = [s for s in r["device_put_shapes"] if int(np.prod(s)) >= pool_elems // 4]
        self.assertEqual(big, [], "a pool-sized device_put ran during the steps")
        self.assertEqual(r["forward_compiles"], 1)
        for kind, shape in r["forward_collectives"]:
            self.assertEqual(kind, "all-reduce")
            self.assertLess(int(np.prod(shape)), pool_elems // 4, shape)


_POOL_CHILD = r"""
import os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
import json, re
import jax
from canary_jax.cli.demo import engine, faults, model, workload
from canary_jax.cli.demo import sharded as demo_sharded

mc = model.ModelConfig(num_kv_heads=4, num_q_heads=4)
cfg = engine.EngineConfig()
reqs = workload.build_requests(workload.load_prompts(None), num_requests=8, max_new_tokens=8)
eng = type("E4", (demo_sharded.ShardedEngine,), {"devices": 4})(cfg, mc, reqs)
puts, real_put = [], jax.device_put
def counting_put(x, *a, **k):
    puts.extend(list(getattr(leaf, "shape", ())) for leaf in jax.tree_util.tree_leaves(x))
    return real_put(x, *a, **k)
jax.device_put = counting_put
steps = 0
for _ in range(10):
    eng.step()
    steps += 1
clean = eng.canary.log.num_violations()
faults._flip_k_bit(eng, int(eng.scheduler.req_to_token[eng.scheduler.running[0].row, 0]), 3, 1)
for _ in range(2):
    eng.step()
    steps += 1
jax.device_put = real_put
compiles = demo_sharded.sharded_forward._cache_size()
b = eng.scheduler.schedule()
args = (b.input_ids, b.positions, b.out_cache_loc, b.token_rows, eng.scheduler.req_to_token, b.sample_index,
        jax.random.PRNGKey(0))
hlo = demo_sharded.sharded_forward.lower(
    eng.params, eng.k_pool, eng.v_pool, *args, cfg=mc, sharding=eng.canary.pool_sharding
).compile().as_text()
kinds = "all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter"
coll = re.findall(r"= [a-z0-9]+\[([0-9,]*)\]\S* (" + kinds + r")\(", hlo)
out = dict(shape=list(eng.k_pool.shape), steps=steps, sweeps=eng.canary.sweep_passes, violations_clean=clean,
           violations_after_flip=eng.canary.log.num_violations(), device_put_shapes=puts,
           forward_compiles=compiles,
           forward_collectives=[[k, [int(d) for d in s.split(",") if d]] for s, k in coll])
for name, pool in (("k", eng.k_pool), ("v", eng.v_pool)):
    spec = list(pool.sharding.spec) + [None] * (pool.ndim - len(pool.sharding.spec))
    out[name + "_devices"] = len(pool.sharding.device_set)
    out[name + "_spec"] = spec
    out[name + "_local"] = [list(s.data.shape) for s in pool.addressable_shards]
print(json.dumps(out))
"""


if __name__ == "__main__":
    unittest.main()
