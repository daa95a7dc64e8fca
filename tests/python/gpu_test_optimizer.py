#!/usr/bin/env python3
"""qtx.cuda's optimizer step on one GPU (CTest label gpu): AdamW offloaded to
qtxd with the gradients in device memory and the FP8 parameters written into
device memory, stream-ordered by interprocess events. The reference is the
same group on a CPU qtxd stepped with the same gradients inline (the C++
client's plain Step): the FP8 bytes must match bit for bit. Also the
data-parallel sharded step (two GPU qtxd owning slices, ShardedStepTest).

  python3 tests/python/gpu_test_optimizer.py --qtxd=build/server/qtxd \
      --python_dir=build/client/python
Shares its helpers (qtxd processes, byte comparison) with gpu_test_cuda.py.
"""

import argparse
import os
import signal
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_test_cuda as base  # noqa: E402

HYPER = (1e-2, 0.9, 0.999, 1e-8, 1e-2, True)


class OptimizerStepTest(unittest.TestCase):
    def test_steps_match_the_cpu_reference(self):
        torch, qcuda = base.torch, base.qcuda
        g = torch.Generator().manual_seed(3)
        masters = {"w1": torch.randn(256, 384, generator=g),
                   "w2": torch.randn(3, 128, 200, generator=g)}
        ref = base.SERVERS["ref"]
        ref.offload_optimizer_state("py-opt", [(n, t.numpy().tobytes(), list(t.shape))
                                               for n, t in masters.items()],
                                    HYPER, 2, 1, True, True, True, 0.0, 0, True,
                                    [(None, None)] * len(masters),  # no per-parameter settings
                                    [None] * len(masters))  # nor shard ranges
        side = torch.cuda.Stream()
        with base.session() as s:
            self.assertEqual(s.offload_optimizer_state(
                "py-opt", masters, lr=HYPER[0], betas=HYPER[1:3], eps=HYPER[3],
                weight_decay=HYPER[4], replace=True), 2)
            lay = {n: qcuda.layout(t.shape, "2d") for n, t in masters.items()}
            outs = {n: {f: torch.empty(l[f], device="cuda",
                                       dtype=torch.float32 if "scale" in f else torch.uint8)
                        for f in qcuda.FIELDS} for n, l in lay.items()}
            for k in range(1, 4):
                gh = {n: (torch.randn(t.shape, generator=g) * 0.1).to(torch.bfloat16)
                      for n, t in masters.items()}
                want = ref.step_host("py-opt", k, [
                    (n, t.view(torch.int16).numpy().tobytes(), 2, list(t.shape))
                    for n, t in gh.items()])
                big = torch.randn(2048, 2048, device="cuda")
                torch.cuda.synchronize()
                with torch.cuda.stream(side):
                    for _ in range(6):  # the "backward" is still running at the call
                        big = big @ big / 45.0
                    grads = {n: torch.zeros(t.shape, device="cuda", dtype=torch.bfloat16)
                             for n, t in gh.items()}
                    for n, t in gh.items():
                        grads[n].copy_(t.to("cuda", non_blocking=False))
                    stats, res = s.step("py-opt", k, grads, out=outs if k == 2 else None)
                    snap = {n: {f: getattr(q, f).clone() for f in qcuda.FIELDS}
                            for n, q in res.items()}
                side.synchronize()
                self.assertEqual(stats["step"], k)
                self.assertFalse(stats["skipped"])
                for n in masters:
                    if k == 2:
                        self.assertIs(res[n].rowwise_data, outs[n]["rowwise_data"])
                    got = qcuda.QuantizedTensor(masters[n].shape, "2d", "e4m3", **snap[n])
                    base.assert_matches(self, got, want[n], "step %d %s" % (k, n))
            with self.assertRaises(qcuda.ArgumentError):
                s.step("py-opt", 4, {"w1": torch.zeros(256, 383, device="cuda")})
            with self.assertRaises(base.qtx.errors.FailedPreconditionError):
                s.step("py-opt", 9, {n: torch.zeros(t.shape, device="cuda")
                                     for n, t in masters.items()})

    def test_per_tensor_output_matches_the_cpu_reference(self):
        # mode='tensor': one scale per parameter, from the amax of its whole
        # updated master (the step, then QuantizeTensor): bytes as the CPU qtxd's.
        torch, qcuda = base.torch, base.qcuda
        g = torch.Generator().manual_seed(5)
        masters = {"w": torch.randn(300, 260, generator=g), "b": torch.randn(260, generator=g)}
        ref = base.SERVERS["ref"]
        ref.offload_optimizer_state("py-opt-tensor", [(n, t.numpy().tobytes(), list(t.shape))
                                                      for n, t in masters.items()],
                                    HYPER, 3, 1, True, True, True, 0.0, 0, True,
                                    [(None, None)] * len(masters), [None] * len(masters))
        with base.session() as s:
            self.assertEqual(s.offload_optimizer_state(
                "py-opt-tensor", masters, lr=HYPER[0], betas=HYPER[1:3], eps=HYPER[3],
                weight_decay=HYPER[4], mode="tensor", replace=True), 2)
            for k in (1, 2):
                gh = {n: (torch.randn(t.shape, generator=g) * 0.1).to(torch.bfloat16)
                      for n, t in masters.items()}
                want = ref.step_host("py-opt-tensor", k, [
                    (n, t.view(torch.int16).numpy().tobytes(), 2, list(t.shape))
                    for n, t in gh.items()])
                grads = {n: t.to("cuda") for n, t in gh.items()}
                stats, res = s.step("py-opt-tensor", k, grads)
                torch.cuda.synchronize()
                self.assertEqual(stats["step"], k)
                for n, t in masters.items():
                    self.assertEqual(tuple(res[n].rowwise_scale_inv.shape), (1,))
                    got = qcuda.QuantizedTensor(t.shape, "tensor", "e4m3",
                                                **{f: getattr(res[n], f) for f in qcuda.FIELDS})
                    base.assert_matches(self, got, want[n], "tensor step %d %s" % (k, n))


class ShardedStepTest(unittest.TestCase):
    """Data-parallel sharded state through qtx.cuda: two qtxd --device=cuda:0
    (the owners; one GPU serves both) in a Gloo Collective group made with
    Session.create_group, each offloading its slices with shards= / shapes=
    and stepping them collectively with device gradients and device FP8
    shards. The reference is the unsharded group on the CPU qtxd stepped with
    the whole gradients: each owner's bytes are its slice of the whole
    rowwise data, its scales the whole ones, bit for bit."""

    def test_each_owners_shard_matches_the_cpu_reference(self):
        torch, qcuda = base.torch, base.qcuda
        if "gpu2" not in base.SERVERS:
            base.SERVERS["gpu2"] = base.start_qtxd("gpu2", ["--device=cuda:0",
                                                            "--allow_client_shm"])
        targets = [base.SERVERS["gpu"], base.SERVERS["gpu2"]]
        shapes = {"w": (300, 260), "b": (1, 200), "e": (130, 129)}
        # Cut mid-row and mid-tile; a slice smaller than a tile; rank 0 owns
        # nothing of "e".
        cuts = {"w": (0, 40000, 78000), "b": (0, 77, 200), "e": (0, 0, 130 * 129)}
        g = torch.Generator().manual_seed(11)
        masters = {n: torch.randn(sh, generator=g) * 0.1 for n, sh in shapes.items()}
        ref = base.SERVERS["ref"]
        ref.offload_optimizer_state("py-shard-ref", [(n, t.numpy().tobytes(), list(t.shape))
                                                     for n, t in masters.items()],
                                    HYPER, 2, 1, True, True, True, 0.0, 0, True,
                                    [(None, None)] * 3, [None] * 3)
        sessions = [qcuda.Session(t) for t in targets]
        try:
            import threading
            infos, errs = [None, None], [None, None]

            def on_both(fn):
                def run(r):
                    try:
                        infos[r] = fn(r, sessions[r])
                    except Exception as e:  # noqa: BLE001 (reported below)
                        errs[r] = e
                ts = [threading.Thread(target=run, args=(r,)) for r in range(2)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                for r in range(2):
                    if errs[r] is not None:
                        raise AssertionError("rank %d: %r" % (r, errs[r]))
                return list(infos)

            on_both(lambda r, s: s.create_group("pydp", r, 2, coordinator=(
                "" if r == 0 else targets[0]), backend="gloo", timeout=60.0))

            def owned(n, r, t):
                return t.reshape(-1)[cuts[n][r]:cuts[n][r + 1]].contiguous()

            counts = on_both(lambda r, s: s.offload_optimizer_state(
                "py-shard", {n: owned(n, r, t) for n, t in masters.items()},
                lr=HYPER[0], betas=HYPER[1:3], eps=HYPER[3], weight_decay=HYPER[4],
                replace=True, shards={n: cuts[n][r:r + 2] for n in shapes}, shapes=shapes))
            self.assertEqual(counts, [3, 3])
            for k in range(1, 4):
                gh = {n: (torch.randn(sh, generator=g) * 0.1).to(torch.bfloat16)
                      for n, sh in shapes.items()}
                want = ref.step_host("py-shard-ref", k, [
                    (n, t.view(torch.int16).numpy().tobytes(), 2, list(t.shape))
                    for n, t in gh.items()])
                # Rank 0 owns nothing of "e": it passes no gradient for it.
                grads = [{n: owned(n, r, t).cuda() for n, t in gh.items()
                          if cuts[n][r] < cuts[n][r + 1]} for r in range(2)]
                torch.cuda.synchronize()
                res = on_both(lambda r, s: s.step("py-shard", k, grads[r],
                                                  collective_group="pydp", sequence=k - 1))
                torch.cuda.synchronize()
                for r in range(2):
                    stats, out = res[r]
                    self.assertEqual(stats["step"], k)
                    for n in shapes:
                        b, e = cuts[n][r], cuts[n][r + 1]
                        label = "step %d rank %d %s [%d, %d)" % (k, r, n, b, e)
                        if b == e:
                            self.assertNotIn(n, out, label)
                            continue
                        q = out[n]
                        self.assertEqual(tuple(q.shape), shapes[n], label)
                        self.assertIsNone(q.columnwise_data, label)
                        self.assertEqual(tuple(q.rowwise_data.shape), (e - b,), label)
                        self.assertEqual(base.host_bytes(q.rowwise_data),
                                         want[n]["rowwise_data"][b:e], label)
                        for f in ("rowwise_scale_inv", "columnwise_scale_inv"):
                            self.assertEqual(base.host_bytes(getattr(q, f)), want[n][f],
                                             label + " " + f)
            # A sharded step without its Collective group: qtxd refuses it.
            with self.assertRaises(base.qtx.errors.FailedPreconditionError):
                sessions[1].step("py-shard", 4, {n: owned(n, 1, masters[n]).cuda()
                                                 for n in shapes})
        finally:
            for s in sessions:
                s.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--qtxd", required=True)
    p.add_argument("--python_dir", required=True)
    base.ARGS, rest = p.parse_known_args()
    setUpModule = base.setUpModule  # noqa: N816
    tearDownModule = base.tearDownModule  # noqa: N816

    def on_term(*_):
        base.tearDownModule()
        os._exit(1)

    signal.signal(signal.SIGTERM, on_term)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
