#!/usr/bin/python3
"""The pip-installable Python package `qtx` (client/python) against a qtxd.

Installs client/python with pip into a temporary --target folder (stubs are
generated from proto/ during the install), imports it from there, starts a
qtxd with a bearer token, a health-only port and client shm, and checks the
wrapper: numpy and torch in/out, FP8 bytes and scales against a decoder
written here, dequantize, shm regions, the error classes, the token and the
Optimizer calls.

  /usr/bin/python3 tests/python/test_package.py --qtxd=build/server/qtxd
"""

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import numpy as np

import qtxd_child

ARGS = None
qtx = None
SERVER = {}
TOKEN = "py-test-token-123"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def fp8_table(exp_bits, man_bits):
    bias = (1 << (exp_bits - 1)) - 1
    out = np.empty(256, dtype=np.float64)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e = (b >> man_bits) & ((1 << exp_bits) - 1)
        m = b & ((1 << man_bits) - 1)
        if exp_bits == 4 and e == 15 and m == 7:
            v = np.nan
        elif exp_bits == 5 and e == 31:
            v = np.inf if m == 0 else np.nan
        elif e == 0:
            v = m / (1 << man_bits) * 2.0 ** (1 - bias)
        else:
            v = (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
        out[b] = sign * v
    return out


E4M3 = fp8_table(4, 3)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install_package(tmp):
    """pip install client/python into tmp/site; returns that folder."""
    src = os.path.join(tmp, "src")
    shutil.copytree(os.path.join(REPO, "client", "python"), src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = os.path.join(tmp, "site")
    env = dict(os.environ, QTX_PROTO_DIR=os.path.join(REPO, "proto"))
    subprocess.check_call(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-build-isolation",
         "--no-deps", "--no-index", "--disable-pip-version-check", "--target", site, src],
        env=env)
    return site


def setUpModule():
    global qtx
    tmp = tempfile.mkdtemp(prefix="qtx-pkg-")
    SERVER["tmp"] = tmp
    site = install_package(tmp)
    sys.path.insert(0, site)
    import qtx as q  # noqa: E402
    qtx = q
    assert os.path.dirname(qtx.__file__) == os.path.join(site, "qtx"), qtx.__file__
    token_file = os.path.join(tmp, "token")
    with open(token_file, "w") as f:
        f.write(TOKEN + "\n")
    SERVER["health_port"] = free_port()
    SERVER["token_file"] = token_file
    SERVER["child"] = qtxd_child.start(
        ARGS.qtxd, tmp, ["--device=cpu", "--allow_client_shm", "--auth_token_file=" + token_file,
                         "--health_port=%d" % SERVER["health_port"]], probe=serving)
    SERVER["target"] = SERVER["child"].target


def serving(target):
    """The qtxd_child probe of a qtxd with the module's token."""
    with qtx.Client(target, token=TOKEN, timeout=2) as c:
        return c.health() == "SERVING"


def tearDownModule():
    child = SERVER.get("child")
    if child is not None:
        child.stop()
    shutil.rmtree(SERVER.get("tmp", "/nonexistent"), ignore_errors=True)


def cdiv(a, b):
    return -(-a // b)


def pad4(x):
    return cdiv(x, 4) * 4


class PackageTest(unittest.TestCase):
    def setUp(self):
        self.c = qtx.Client(SERVER["target"], token_file=SERVER["token_file"], timeout=30)

    def tearDown(self):
        self.c.close()

    def check_rowwise_1d(self, x, q):
        m, n = x.shape
        self.assertEqual(q.rowwise_data.shape, (m, n))
        self.assertEqual(q.rowwise_data.dtype, np.uint8)
        self.assertEqual(q.rowwise_scale_inv.shape, (cdiv(n, 128), pad4(m)))
        s = q.rowwise_scale_inv[np.arange(n)[None, :] // 128, np.arange(m)[:, None]]
        recon = (E4M3[q.rowwise_data].astype(np.float32) * s).astype(np.float32)
        bound = np.maximum(np.abs(x) * 2.0**-4, s * 2.0**-10) * 1.0001
        self.assertTrue(np.all(np.abs(recon - x) <= bound),
                        "max excess %g" % np.max(np.abs(recon - x) - bound))
        # pow2 scales: scale_inv is a power of two
        used = q.rowwise_scale_inv[:, :m]
        self.assertTrue(np.all(np.log2(used) == np.round(np.log2(used))))
        return recon

    def test_numpy_1d_rowwise_columnwise_and_dequantize(self):
        rng = np.random.default_rng(1)
        x = (rng.standard_normal((200, 300)) * 3).astype(np.float32)
        q = self.c.quantize(x, mode="1d", columnwise=True)
        self.assertEqual(q.shape, (200, 300))
        recon = self.check_rowwise_1d(x, q)
        self.assertEqual(q.columnwise_data.shape, (300, 200))
        self.assertEqual(q.columnwise_scale_inv.shape, (cdiv(200, 128), pad4(300)))
        y = self.c.dequantize(q)
        self.assertIsInstance(y, np.ndarray)
        self.assertEqual(y.dtype, np.float32)
        np.testing.assert_array_equal(y, recon)

    def test_numpy_tensor_mode_one_scale(self):
        rng = np.random.default_rng(7)
        x = (rng.standard_normal((100, 70)) * 5).astype(np.float32)
        q = self.c.quantize(x, mode="tensor", columnwise=True, pow2_scales=False)
        self.assertEqual(q.rowwise_scale_inv.shape, (1,))
        self.assertEqual(q.columnwise_scale_inv.shape, (1,))
        # One scale from the tensor's amax, FP32 arithmetic (numpy rounds each op).
        scale = np.float32(448.0) / np.float32(np.abs(x).max())
        scale_inv = np.float32(1.0) / scale
        self.assertEqual(q.rowwise_scale_inv[0], scale_inv)
        self.assertEqual(q.columnwise_scale_inv[0], scale_inv)
        np.testing.assert_array_equal(q.columnwise_data, q.rowwise_data.T)
        # Every byte is an FP8 value nearest to the FP32 product x * scale.
        v = (x * scale).astype(np.float32).astype(np.float64)
        got = E4M3[q.rowwise_data.astype(np.int64)]
        grid = E4M3[np.isfinite(E4M3)]
        nearest = np.abs(v[..., None] - grid[None, None, :]).min(axis=-1)
        np.testing.assert_array_equal(np.abs(got - v), nearest)
        y = self.c.dequantize(q)
        np.testing.assert_array_equal(y, (got * np.float64(scale_inv)).astype(np.float32))

    def test_numpy_2d_float16(self):
        rng = np.random.default_rng(2)
        x = rng.standard_normal((130, 260)).astype(np.float16)
        q = self.c.quantize(x, mode="2d", format="e5m2", columnwise=True)
        self.assertEqual(q.rowwise_scale_inv.shape, (2, pad4(3)))
        self.assertEqual(q.columnwise_scale_inv.shape, (3, pad4(2)))
        y = self.c.dequantize(q, dtype="float16")
        self.assertEqual(y.dtype, np.float16)
        err = np.abs(y.astype(np.float32) - x.astype(np.float32))
        self.assertLess(float(err.max()), 0.3)

    def test_torch_bfloat16_in_and_out(self):
        try:
            import torch
        except Exception:
            self.skipTest("torch not importable")
        torch.manual_seed(0)
        x = torch.randn(64, 256, dtype=torch.bfloat16)
        q = self.c.quantize(x, mode="1d")
        self.assertIsInstance(q.rowwise_data, torch.Tensor)
        self.assertEqual(q.rowwise_data.dtype, torch.uint8)
        self.assertEqual(tuple(q.rowwise_data.shape), (64, 256))
        y = self.c.dequantize(q, dtype="bfloat16")
        self.assertIsInstance(y, torch.Tensor)
        self.assertEqual(y.dtype, torch.bfloat16)
        rel = ((y.float() - x.float()).abs() / x.float().abs().clamp_min(1e-2)).max().item()
        self.assertLess(rel, 0.15)
        # Same bytes as the float32 path for the same values.
        q32 = self.c.quantize(x.float().numpy(), mode="1d")
        np.testing.assert_array_equal(q.rowwise_data.numpy(), q32.rowwise_data)

    def test_shm_region_matches_inline(self):
        rng = np.random.default_rng(3)
        x = rng.standard_normal((128, 384)).astype(np.float32)
        with qtx.ShmRegion("py-region", x.nbytes + 64) as region:
            region.view(64, np.float32, x.shape)[...] = x
            self.c.register_shm_region(region)
            names = [r.name for r in self.c.list_regions()]
            self.assertIn("py-region", names)
            q = self.c.quantize_region(region, 64, x.shape, mode="2d")
            inline = self.c.quantize(x, mode="2d")
            np.testing.assert_array_equal(q.rowwise_data, inline.rowwise_data)
            np.testing.assert_array_equal(q.rowwise_scale_inv, inline.rowwise_scale_inv)
            with self.assertRaises(ValueError):
                region.view(64, np.float32, (129, 384))
            self.c.unregister_region("py-region")
        with self.assertRaises(qtx.errors.NotFoundError) as cm:
            self.c.unregister_region("py-region")
        self.assertIn("py-region", cm.exception.message)

    def test_error_classes(self):
        with self.assertRaises(qtx.errors.InvalidArgumentError) as cm:
            self.c.quantize(np.zeros((4, 8), np.float32), rowwise=False, columnwise=False)
        self.assertEqual(cm.exception.code.name, "INVALID_ARGUMENT")
        self.assertIsInstance(cm.exception, qtx.QtxError)
        with self.assertRaises(TypeError):
            self.c.quantize(np.zeros((4, 8), np.int32))
        ref = qtx.tensor_pb2.TensorRef(
            dtype=qtx.tensor_pb2.FLOAT32, shape=[4, 8],
            region=qtx.tensor_pb2.RegionSlice(region="nope", offset=0, size=128))
        with self.assertRaises(qtx.errors.NotFoundError):
            self.c.quantize(ref)

    def test_token_is_required(self):
        with qtx.Client(SERVER["target"], timeout=10) as anonymous:
            with self.assertRaises(qtx.errors.UnauthenticatedError):
                anonymous.health()
        with qtx.Client(SERVER["target"], token="wrong", timeout=10) as wrong:
            with self.assertRaises(qtx.errors.UnauthenticatedError) as cm:
                wrong.quantize(np.ones((2, 2), np.float32))
            self.assertNotIn("wrong", cm.exception.message)

    def test_health_port_without_token(self):
        with qtx.Client("127.0.0.1:%d" % SERVER["health_port"], timeout=10) as h:
            self.assertEqual(h.health(), "SERVING")
            with self.assertRaises(qtx.errors.UnimplementedError):
                h.list_regions()

    def test_wait_until_serving(self):
        # A serving qtxd: returns.
        self.c.wait_until_serving(30)
        # Without the token, the health checks fail: the wait names why.
        with qtx.Client(SERVER["target"], timeout=10) as anonymous:
            with self.assertRaises(qtx.errors.DeadlineExceededError) as cm:
                anonymous.wait_until_serving(0.5)
            self.assertIn("not SERVING after 0.5 s", cm.exception.message)
            self.assertIn("UNAUTHENTICATED", cm.exception.message)
        # Nothing on the socket yet: waits, and returns once a qtxd starts there.
        late = os.path.join(SERVER["tmp"], "late")
        os.mkdir(late)
        outcome = []

        def wait():
            with qtx.Client("unix://" + os.path.join(late, "qtxd.sock"), token=TOKEN) as c:
                try:
                    c.wait_until_serving(60)
                    outcome.append("serving")
                except qtx.QtxError as e:
                    outcome.append(e)
        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.3)
        self.assertEqual(outcome, [])  # nothing serves there yet
        child = qtxd_child.start(ARGS.qtxd, late,
                                 ["--device=cpu", "--auth_token_file=" + SERVER["token_file"]])
        try:
            waiter.join(60)
            self.assertEqual(outcome, ["serving"])
        finally:
            self.assertEqual(child.stop(), 0)
        # No qtxd at all: DEADLINE_EXCEEDED naming the target.
        with qtx.Client("unix://" + os.path.join(late, "none.sock"), token=TOKEN) as c:
            with self.assertRaises(qtx.errors.DeadlineExceededError) as cm:
                c.wait_until_serving(0.3)
            self.assertIn("none.sock", cm.exception.message)

    def test_optimizer_calls(self):
        # The installed package's Optimizer wrapper, with the token (the AdamW
        # numerics are checked in test_client_optimizer.py).
        w = np.full((2, 128), 0.5, np.float32)
        info = self.c.offload_optimizer_state("py-pkg", {"w": w}, lr=0.1, weight_decay=0.0)
        self.assertEqual((info.name, info.step, info.num_elements), ("py-pkg", 0, 256))
        r = self.c.step("py-pkg", 1, {"w": np.ones_like(w)})
        self.assertEqual(r.stats.step, 1)
        master = self.c.get_state("py-pkg").parameters["w"].master
        self.assertLess(float(np.max(master)), 0.5)  # moved against the gradient
        ref = self.c.quantize(master, mode="2d", columnwise=True)
        np.testing.assert_array_equal(r.parameters["w"].fp8.rowwise_data, ref.rowwise_data)
        np.testing.assert_array_equal(r.parameters["w"].fp8.columnwise_data,
                                      ref.columnwise_data)
        with self.assertRaises(qtx.errors.FailedPreconditionError):
            self.c.step("py-pkg", 3, {"w": np.ones_like(w)})
        self.c.release_group("py-pkg")
        self.assertEqual(self.c.list_optimizer_groups().groups, [])


class CollectiveTest(unittest.TestCase):
    """create_group / all_gather / list_groups / destroy_group: the module's
    qtxd is rank 0, a second qtxd with the same token is rank 1."""

    @classmethod
    def setUpClass(cls):
        cls.child = qtxd_child.start(
            ARGS.qtxd, SERVER["tmp"], ["--device=cpu", "--auth_token_file=" + SERVER["token_file"]],
            probe=serving, name="rank1")
        cls.targets = [SERVER["target"], cls.child.target]

    @classmethod
    def tearDownClass(cls):
        cls.child.stop()

    def setUp(self):
        self.clients = [qtx.Client(t, token=TOKEN, timeout=30) for t in self.targets]

    def tearDown(self):
        for c in self.clients:
            c.close()

    def on_every_rank(self, fn):
        """fn(rank, client) on one thread per rank: results or exceptions."""
        out = [None, None]

        def run(r):
            try:
                out[r] = fn(r, self.clients[r])
            except Exception as e:  # noqa: BLE001 - returned to the test
                out[r] = e

        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def test_all_gather_equals_quantize_of_concatenation(self):
        infos = self.on_every_rank(lambda r, c: c.create_group(
            "py-tp", r, 2, coordinator="" if r == 0 else self.targets[0], backend="gloo",
            group_timeout=20))
        for r, info in enumerate(infos):
            self.assertNotIsInstance(info, Exception, msg=str(info))
            self.assertEqual((info.name, info.rank, info.world_size), ("py-tp", r, 2))
            self.assertEqual(info.state, qtx.collective_pb2.READY)
        rng = np.random.default_rng(7)
        seq = 0
        for rows in ((100, 29), (0, 300)):
            x = [(rng.standard_normal((m, 200)) * (4.0 if r else 0.25)).astype(np.float32)
                 for r, m in enumerate(rows)]
            for mode in ("1d", "2d", "tensor"):
                ref = self.clients[0].quantize(np.concatenate(x), mode=mode, columnwise=True)
                # shard_rows given: the one-round path (same bytes).
                for gather_mode, shard_rows in (("exact_fp8", None),
                                                ("gather_high_precision", None),
                                                ("exact_fp8", list(rows))):
                    res = self.on_every_rank(lambda r, c: c.all_gather(
                        "py-tp", seq, x[r], gather_mode=gather_mode, mode=mode,
                        columnwise=True, shard_rows=shard_rows))
                    seq += 1
                    for r in range(2):
                        self.assertNotIsInstance(res[r], Exception, msg=str(res[r]))
                        self.assertEqual(res[r].shard_rows, list(rows))
                        self.assertEqual(res[r].tensor.shape, (sum(rows), 200))
                        for f in ("rowwise_data", "rowwise_scale_inv", "columnwise_data",
                                  "columnwise_scale_inv"):
                            np.testing.assert_array_equal(
                                getattr(res[r].tensor, f), getattr(ref, f),
                                err_msg="%s %s %s rank %d" % (rows, mode, gather_mode, r))
        # Ranks that disagree on N: INVALID_ARGUMENT on both, naming n.
        res = self.on_every_rank(lambda r, c: c.all_gather(
            "py-tp", seq, np.ones((8, 128 if r == 0 else 64), np.float32)))
        for e in res:
            self.assertIsInstance(e, qtx.errors.InvalidArgumentError)
            self.assertIn("disagree on n", e.message)
        for r, c in enumerate(self.clients):
            groups = c.list_groups()
            self.assertEqual([(g.name, g.rank, g.state, g.next_sequence) for g in groups],
                             [("py-tp", r, qtx.collective_pb2.READY, seq + 1)])
            c.destroy_group("py-tp")
            self.assertEqual(c.list_groups(), [])
            with self.assertRaises(qtx.errors.NotFoundError):
                c.destroy_group("py-tp")
        with self.assertRaises(ValueError):
            self.clients[0].all_gather("py-tp", 0, x[0], gather_mode="fast")


class ThreeRankCollectiveTest(unittest.TestCase):
    """all_gather over three CPU qtxd (the module's is rank 0) with uneven
    shards of 300, 257 and 130 rows (and a rank with none): every rank's
    gathered bytes equal quantize() of the concatenation. The multi-rank
    path of a GPU needs one GPU per rank (tests/python/gpu_test_allgather_ranks.py
    shows why two ranks cannot share one); this covers it in CI."""

    @classmethod
    def setUpClass(cls):
        cls.children = [qtxd_child.start(
            ARGS.qtxd, SERVER["tmp"], ["--device=cpu", "--auth_token_file=" + SERVER["token_file"]],
            probe=serving, name="three-rank%d" % r) for r in (1, 2)]
        cls.targets = [SERVER["target"]] + [c.target for c in cls.children]

    @classmethod
    def tearDownClass(cls):
        for c in cls.children:
            c.stop()

    def setUp(self):
        self.clients = [qtx.Client(t, token=TOKEN, timeout=30) for t in self.targets]

    def tearDown(self):
        for c in self.clients:
            c.close()

    def on_every_rank(self, fn):
        out = [None] * 3

        def run(r):
            try:
                out[r] = fn(r, self.clients[r])
            except Exception as e:  # noqa: BLE001 - returned to the test
                out[r] = e

        threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def test_uneven_shards_equal_quantize_of_concatenation(self):
        infos = self.on_every_rank(lambda r, c: c.create_group(
            "py-3r", r, 3, coordinator="" if r == 0 else self.targets[0], backend="gloo",
            group_timeout=20))
        for r, info in enumerate(infos):
            self.assertNotIsInstance(info, Exception, msg=str(info))
            self.assertEqual((info.rank, info.world_size), (r, 3))
        rng = np.random.default_rng(13)
        seq = 0
        for rows in ((300, 257, 130), (257, 0, 300)):
            x = [(rng.standard_normal((m, 384)) * (0.5, 8.0, 0.01)[r]).astype(np.float32)
                 for r, m in enumerate(rows)]
            for mode in ("1d", "2d", "tensor"):
                ref = self.clients[0].quantize(np.concatenate(x), mode=mode, columnwise=True)
                for gather_mode, shard_rows in (("exact_fp8", None),
                                                ("gather_high_precision", list(rows))):
                    res = self.on_every_rank(lambda r, c: c.all_gather(
                        "py-3r", seq, x[r], gather_mode=gather_mode, mode=mode,
                        columnwise=True, shard_rows=shard_rows))
                    seq += 1
                    for r in range(3):
                        self.assertNotIsInstance(res[r], Exception, msg=str(res[r]))
                        self.assertEqual(res[r].shard_rows, list(rows))
                        self.assertEqual(res[r].tensor.shape, (sum(rows), 384))
                        for f in ("rowwise_data", "rowwise_scale_inv", "columnwise_data",
                                  "columnwise_scale_inv"):
                            np.testing.assert_array_equal(
                                getattr(res[r].tensor, f), getattr(ref, f),
                                err_msg="%s %s %s rank %d" % (rows, mode, gather_mode, r))
        for c in self.clients:
            c.destroy_group("py-3r")


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--qtxd", required=True)
    ARGS, rest = parser.parse_known_args()
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
