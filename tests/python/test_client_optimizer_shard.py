#!/usr/bin/python3
"""qtx.Client's data-parallel sharded optimizer state against two qtxd
(--device=cpu) in a Gloo Collective group.

* a [200, 130] parameter cut mid-tile between two owners ([0, 13000) and
  [13000, 26000)) and a [1, 200] one that rank 0 owns whole (rank 1: the
  empty range), offloaded with shards= on rank 0 and ParameterInit.shard on
  rank 1, stepped on both ranks at once (threads) with collective_group /
  sequence: each owner's FP8 bytes are its slice of the rowwise data an
  unsharded group on rank 0's sidecar returns for the whole parameter and
  whole gradient (so the concatenation is the whole data), the scale_inv
  tensors are the whole ones, there is no columnwise data, the BF16 copy and
  get_state's master / moments are the owned slices (1-D), bit for bit;
* OptimizerGroupInfo.parameter_shards and num_elements report the ranges;
* optimizer_state_dict refuses a sharded group;
* load_checkpoint(sources=, shards=): both owners' checkpoints loaded whole
  on one sidecar and at other cuts on both (get_state = the whole group's);
* all_gather_parameter of each owner's FP8 shard as step() returned it: the
  whole rowwise copy on both ranks, byte for byte the unsharded group's; of
  shards cut from quantize()'s output, and its errors (overlapping ranges,
  different scales: InvalidArgumentError on both ranks);
* errors: overlapping ranges (InvalidArgumentError on both ranks), a step
  without collective_group (FailedPreconditionError), and the client's own
  checks of the ranges (ValueError).

  /usr/bin/python3 tests/python/test_client_optimizer_shard.py \\
      --qtxd=build/server/qtxd --python_dir=build/client/python
"""

import argparse
import os
import shutil
import sys
import tempfile
import threading
import unittest

import numpy as np

import qtxd_child

ARGS = None
qtx = None
SERVERS = {"children": [], "targets": []}
CLIENTS = []
SEQ = [0]  # the Collective group "dp"'s next sequence (every collective call uses one)

F32 = np.float32
SHAPES = {"w": (200, 130), "b": (1, 200)}
CUTS = {"w": (0, 13000, 26000), "b": (0, 200, 200)}  # rank r owns [CUTS[r], CUTS[r + 1])
LR, WD = 1e-2, 0.1


def start_qtxd(tmp, name):
    def serving(target):
        with qtx.Client(target, timeout=2) as c:
            return c.health() == "SERVING"
    child = qtxd_child.start(ARGS.qtxd, tmp,
                             ["--device=cpu", "--checkpoint_dir=" + os.path.join(tmp, name),
                              "--checkpoint_import_dirs=" + tmp], probe=serving, name=name)
    SERVERS["children"].append(child)
    return child.target


def on_every_rank(fn):
    """fn(rank, client) on one thread per rank: the results or exceptions."""
    out = [None, None]

    def run(r):
        try:
            out[r] = fn(r, CLIENTS[r])
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def setUpModule():
    SERVERS["tmp"] = tempfile.mkdtemp(prefix="qtx-pyshard-")
    for r in range(2):
        SERVERS["targets"].append(start_qtxd(SERVERS["tmp"], "rank%d" % r))
        CLIENTS.append(qtx.Client(SERVERS["targets"][r], timeout=60))
    infos = on_every_rank(lambda r, c: c.create_group(
        "dp", r, 2, coordinator="" if r == 0 else SERVERS["targets"][0], backend="gloo",
        group_timeout=30))
    for info in infos:
        if isinstance(info, Exception):
            raise info


def tearDownModule():
    for c in CLIENTS:
        c.close()
    for child in SERVERS["children"]:
        child.stop()
    shutil.rmtree(SERVERS.get("tmp", "/nonexistent"), ignore_errors=True)


def values(count, seed, scale):
    """Normal values whose magnitude changes along the flattened index, so
    that the two owners of a cut tile see different partial amaxes."""
    rng = np.random.default_rng(seed)
    i = np.arange(count)
    return (rng.standard_normal(count) * scale
            * np.ldexp(1.0, (i // 911) % 9 - 4)).astype(F32)


def whole(name, seed, scale):
    return values(int(np.prod(SHAPES[name])), seed, scale).reshape(SHAPES[name])


def collective_step(group, step, grads_of_rank, **kwargs):
    """step() on both ranks at once with the next sequence of "dp"."""
    seq = SEQ[0]
    SEQ[0] += 1
    return on_every_rank(lambda r, c: c.step(group, step, grads_of_rank(r),
                                             collective_group="dp", sequence=seq, **kwargs))


def owned(name, r, flat):
    b, e = CUTS[name][r], CUTS[name][r + 1]
    return np.ascontiguousarray(np.asarray(flat).reshape(-1)[b:e])


class ShardedStepTest(unittest.TestCase):

    def test_each_owners_fp8_shard_is_its_part_of_the_whole_parameter(self):
        masters = {n: whole(n, 10 + k, 0.1) for k, n in enumerate(SHAPES)}
        out = dict(output="fp8", mode="2d", rowwise=True, columnwise=True, bf16_copy=True,
                   lr=LR, weight_decay=WD)
        ref = CLIENTS[0]
        ref.offload_optimizer_state("ref", masters, **out)

        def offload(r, c):
            if r == 0:  # the shards= argument
                params = [qtx.ParameterInit(n, owned(n, 0, masters[n]), shape=SHAPES[n])
                          for n in SHAPES]
                return c.offload_optimizer_state(
                    "opt", params, shards={n: CUTS[n][:2] for n in SHAPES}, **out)
            # ParameterInit.shard
            return c.offload_optimizer_state("opt", [
                qtx.ParameterInit(n, owned(n, 1, masters[n]), shape=SHAPES[n],
                                  shard=CUTS[n][1:]) for n in SHAPES], **out)

        infos = on_every_rank(offload)
        for r, info in enumerate(infos):
            self.assertNotIsInstance(info, Exception, msg=str(info))
            self.assertEqual(info.parameter_shards,
                             {n: (CUTS[n][r], CUTS[n][r + 1]) for n in SHAPES})
            self.assertEqual(info.num_elements,
                             sum(CUTS[n][r + 1] - CUTS[n][r] for n in SHAPES))
        listed = {g.name: g for g in CLIENTS[1].list_optimizer_groups().groups}
        self.assertEqual(listed["opt"].parameter_shards, {"w": (13000, 26000), "b": (200, 200)})

        for step in (1, 2):
            grads = {n: whole(n, 100 * step + k, 1.0) for k, n in enumerate(SHAPES)}
            want = ref.step("ref", step, grads)
            res = collective_step("opt", step,
                                  lambda r: {n: owned(n, r, grads[n]) for n in SHAPES})
            for r in range(2):
                self.assertNotIsInstance(res[r], Exception, msg="rank %d: %s" % (r, res[r]))
                self.assertFalse(res[r].stats.replayed)
                self.assertEqual(list(res[r].parameters), list(SHAPES))
            for n in SHAPES:
                w = want.parameters[n]
                pieces = []
                for r in range(2):
                    b, e = CUTS[n][r], CUTS[n][r + 1]
                    o = res[r].parameters[n]
                    msg = "step %d rank %d %s [%d, %d)" % (step, r, n, b, e)
                    self.assertEqual(o.fp8.shape, SHAPES[n], msg=msg)
                    self.assertEqual(o.fp8.rowwise_data.shape, (e - b,), msg=msg)
                    self.assertEqual(o.fp8.rowwise_data.dtype, np.uint8, msg=msg)
                    np.testing.assert_array_equal(
                        o.fp8.rowwise_data, owned(n, r, w.fp8.rowwise_data), err_msg=msg)
                    self.assertEqual(o.fp8.rowwise_scale_inv.tobytes(),
                                     w.fp8.rowwise_scale_inv.tobytes(), msg=msg)
                    self.assertEqual(o.fp8.rowwise_scale_inv.shape, w.fp8.rowwise_scale_inv.shape)
                    self.assertEqual(o.fp8.columnwise_scale_inv.tobytes(),
                                     w.fp8.columnwise_scale_inv.tobytes(), msg=msg)
                    self.assertIsNone(o.fp8.columnwise_data, msg=msg)
                    self.assertEqual(o.bf16.shape, (e - b,), msg=msg)
                    np.testing.assert_array_equal(o.bf16, owned(n, r, w.bf16), err_msg=msg)
                    pieces.append(o.fp8.rowwise_data)
                # Concatenated in range order: the whole rowwise data.
                self.assertEqual(np.concatenate(pieces).tobytes(),
                                 w.fp8.rowwise_data.tobytes())
                # all_gather_parameter of the shards as step() returned them:
                # the whole rowwise copy on both ranks.
                seq = SEQ[0]
                SEQ[0] += 1
                gathered = on_every_rank(lambda r, c: c.all_gather_parameter(
                    "dp", seq, res[r].parameters[n].fp8, CUTS[n][r:r + 2], name=n))
                for r in range(2):
                    msg = "step %d rank %d %s gathered" % (step, r, n)
                    g = gathered[r]
                    self.assertNotIsInstance(g, Exception, msg="%s: %s" % (msg, g))
                    self.assertEqual(g.ranges, [CUTS[n][0:2], CUTS[n][1:3]], msg=msg)
                    self.assertEqual(g.tensor.mode, "2d", msg=msg)
                    self.assertEqual(g.tensor.rowwise_data.shape, SHAPES[n], msg=msg)
                    self.assertEqual(g.tensor.rowwise_data.tobytes(),
                                     w.fp8.rowwise_data.tobytes(), msg=msg)
                    self.assertEqual(g.tensor.rowwise_scale_inv.tobytes(),
                                     w.fp8.rowwise_scale_inv.tobytes(), msg=msg)
                    self.assertIsNone(g.tensor.columnwise_data, msg=msg)

        # A retried step replays the same shards.
        grads = {n: whole(n, 200 + k, 1.0) for k, n in enumerate(SHAPES)}
        again = collective_step("opt", 2, lambda r: {n: owned(n, r, grads[n]) for n in SHAPES})
        for r in range(2):
            self.assertNotIsInstance(again[r], Exception, msg=str(again[r]))
            self.assertTrue(again[r].stats.replayed)
            self.assertEqual(again[r].parameters["w"].fp8.rowwise_data.tobytes(),
                             res[r].parameters["w"].fp8.rowwise_data.tobytes())

        # get_state: the owned slices, 1-D, bit for bit the whole group's.
        whole_state = ref.get_state("ref", include_moments=True)
        for r, c in enumerate(CLIENTS):
            st = c.get_state("opt", include_moments=True)
            self.assertEqual(st.group.parameter_shards,
                             {n: (CUTS[n][r], CUTS[n][r + 1]) for n in SHAPES})
            for n in SHAPES:
                e = CUTS[n][r + 1] - CUTS[n][r]
                for f in ("master", "exp_avg", "exp_avg_sq"):
                    got = getattr(st.parameters[n], f)
                    self.assertEqual(got.shape, (e,), msg="rank %d %s.%s" % (r, n, f))
                    self.assertEqual(got.tobytes(),
                                     owned(n, r, getattr(whole_state.parameters[n], f)).tobytes(),
                                     msg="rank %d %s.%s" % (r, n, f))
        # Resharding from both owners' checkpoints: rank 1 alone, unsharded;
        # both ranks at other cuts. The state is the whole group's, bit for bit.
        for r, c in enumerate(CLIENTS):
            c.save_checkpoint("opt")
        files = [os.path.join(SERVERS["tmp"], "rank%d" % r, "opt.qtxopt") for r in range(2)]
        info = CLIENTS[1].load_checkpoint("whole", sources=files)
        self.assertEqual((info.step, info.parameter_shards), (2, {}))
        st = CLIENTS[1].get_state("whole", include_moments=True)
        for n in SHAPES:
            for f in ("master", "exp_avg", "exp_avg_sq"):
                self.assertEqual(getattr(st.parameters[n], f).tobytes(),
                                 getattr(whole_state.parameters[n], f).tobytes(), msg=n + f)
        new_cuts = {"w": (0, 5000, 26000), "b": (0, 0, 200)}
        infos = on_every_rank(lambda r, c: c.load_checkpoint(
            "re", sources=files, shards={n: new_cuts[n][r:r + 2] for n in SHAPES}))
        for r, c in enumerate(CLIENTS):
            self.assertNotIsInstance(infos[r], Exception, msg=str(infos[r]))
            st = c.get_state("re")
            for n in SHAPES:
                b, e = new_cuts[n][r], new_cuts[n][r + 1]
                self.assertEqual(st.parameters[n].master.tobytes(),
                                 whole_state.parameters[n].master.reshape(-1)[b:e].tobytes())
            c.release_group("re")
        with self.assertRaises(qtx.errors.InvalidArgumentError) as cm:
            CLIENTS[0].load_checkpoint("re", sources=files[:1])
        self.assertIn("are in no source", str(cm.exception))
        with self.assertRaises(ValueError):
            CLIENTS[0].load_checkpoint("re", shards={"w": (0, 1)})
        CLIENTS[1].release_group("whole")
        # torch's state_dict form has no ranges: refused rather than 1-D slices.
        with self.assertRaises(ValueError) as cm:
            CLIENTS[1].optimizer_state_dict("opt")
        self.assertIn("sharded", str(cm.exception))
        ref.release_group("ref")
        on_every_rank(lambda r, c: c.release_group("opt"))


class ShardErrorsTest(unittest.TestCase):

    def test_overlapping_ranges_fail_on_both_ranks(self):
        m = whole("w", 3, 0.1)
        cuts = [(0, 10000), (9000, 26000)]
        infos = on_every_rank(lambda r, c: c.offload_optimizer_state(
            "overlap", {"w": qtx.ParameterInit("w", owned_range(m, cuts[r]), shape=SHAPES["w"])},
            shards={"w": cuts[r]}))
        for info in infos:
            self.assertNotIsInstance(info, Exception, msg=str(info))
        g = whole("w", 4, 1.0)
        res = collective_step("overlap", 1, lambda r: {"w": owned_range(g, cuts[r])})
        for r in range(2):
            self.assertIsInstance(res[r], qtx.errors.InvalidArgumentError, msg=str(res[r]))
            self.assertIn("overlap", res[r].message)
        # Nothing changed: the group is still at step 0.
        for c in CLIENTS:
            self.assertEqual(c.get_state("overlap").group.step, 0)
        on_every_rank(lambda r, c: c.release_group("overlap"))

    def test_all_gather_parameter_checks_ranges_and_scales(self):
        # Shards cut from one quantization of a [200, 130] tensor (bytes and
        # scales given directly).
        with qtx.Client(SERVERS["targets"][0]) as c:
            q = c.quantize(whole("w", 8, 1.0), mode="2d")
        data = q.rowwise_data.reshape(-1)
        cuts = [(0, 13001), (13001, 26000)]

        def gather(ranges, scales):
            seq = SEQ[0]
            SEQ[0] += 1
            return on_every_rank(lambda r, c: c.all_gather_parameter(
                "dp", seq, data[ranges[r][0]:ranges[r][1]], ranges[r], scale_inv=scales[r],
                shape=SHAPES["w"]))

        good = gather(cuts, [q.rowwise_scale_inv] * 2)
        for g in good:
            self.assertNotIsInstance(g, Exception, msg=str(g))
            self.assertEqual(g.tensor.rowwise_data.tobytes(), q.rowwise_data.tobytes())
        overlap = [(0, 13001), (13000, 26000)]
        for e in gather(overlap, [q.rowwise_scale_inv] * 2):
            self.assertIsInstance(e, qtx.errors.InvalidArgumentError, msg=str(e))
            self.assertIn("overlap", e.message)
        other = q.rowwise_scale_inv.copy()
        other[0, 0] *= 2
        for e in gather(cuts, [q.rowwise_scale_inv, other]):
            self.assertIsInstance(e, qtx.errors.InvalidArgumentError, msg=str(e))
            self.assertIn("rowwise_scale_inv", e.message)
            self.assertIn("rank 1", e.message)

    def test_step_without_collective_group_is_refused(self):
        m = whole("w", 5, 0.1)
        CLIENTS[0].offload_optimizer_state(
            "solo-shard", [qtx.ParameterInit("w", owned("w", 0, m), shape=SHAPES["w"],
                                             shard=CUTS["w"][:2])])
        with self.assertRaises(qtx.errors.FailedPreconditionError) as cm:
            CLIENTS[0].step("solo-shard", 1, {"w": owned("w", 0, whole("w", 6, 1.0))})
        self.assertIn("collective_group", cm.exception.message)
        self.assertEqual(CLIENTS[0].get_state("solo-shard").group.step, 0)
        CLIENTS[0].release_group("solo-shard")
        # An unsharded group reports no ranges. (Its Step with collective_group is a
        # collective call too, refused on every rank: tests/client/optimizer_shard_e2e_test.cc.)
        self.assertEqual(CLIENTS[0].offload_optimizer_state("plain", {"w": m}).parameter_shards,
                         {})
        CLIENTS[0].release_group("plain")

    def test_client_checks_the_ranges(self):
        c = CLIENTS[0]
        m = whole("w", 7, 0.1).reshape(-1)
        cases = [
            ((100, 50), m[:50], "0 <= begin <= end <= 26000"),   # begin > end
            ((-1, 10), m[:11], "0 <= begin <= end <= 26000"),    # begin < 0
            ((20000, 26001), m[:6001], "0 <= begin <= end <= 26000"),  # past the end
            ((0, 100), m[:99], "master has 99 elements"),        # slice size mismatch
        ]
        for shard, master, msg in cases:
            with self.assertRaises(ValueError) as cm:
                c.offload_optimizer_state("bad", [qtx.ParameterInit("w", master,
                                                                    shape=SHAPES["w"])],
                                          shards={"w": shard})
            self.assertIn(msg, str(cm.exception))
            self.assertIn("parameter w", str(cm.exception))
        with self.assertRaises(ValueError) as cm:  # moments of another size
            c.offload_optimizer_state("bad", [qtx.ParameterInit(
                "w", m[:100], exp_avg=m[:100], exp_avg_sq=m[:90], shape=SHAPES["w"],
                shard=(0, 100))])
        self.assertIn("exp_avg_sq has 90 elements", str(cm.exception))
        with self.assertRaises(ValueError) as cm:  # no whole shape
            c.offload_optimizer_state("bad", {"w": m[:100]}, shards={"w": (0, 100)})
        self.assertIn("needs shape=", str(cm.exception))
        with self.assertRaises(ValueError):  # an unknown name
            c.offload_optimizer_state("bad", {"w": m[:100]}, shards={"v": (0, 100)})
        with self.assertRaises(ValueError):  # not a pair
            c.offload_optimizer_state("bad", [qtx.ParameterInit("w", m[:100],
                                                                shape=SHAPES["w"])],
                                      shards={"w": 100})
        self.assertNotIn("bad", [g.name for g in c.list_optimizer_groups().groups])


def owned_range(a, cut):
    return np.ascontiguousarray(np.asarray(a).reshape(-1)[cut[0]:cut[1]])


def main():
    global ARGS, qtx
    parser = argparse.ArgumentParser()
    parser.add_argument("--qtxd", required=True)
    parser.add_argument("--python_dir", required=True)
    ARGS, rest = parser.parse_known_args()
    sys.path.insert(0, ARGS.python_dir)
    import qtx as qtx_pkg
    qtx = qtx_pkg
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
