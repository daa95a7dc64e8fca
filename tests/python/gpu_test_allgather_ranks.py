#!/usr/bin/env python3
"""qtx.cuda's all_gather with two ranks on ONE GPU (CTest label gpu).

Two qtxd --device=cuda:0 (one per rank) and one CPU qtxd for the reference;
this process is both ranks (a thread and a qtx.cuda.Session per rank).
Uneven shards of 300 and 257 rows, [*, 512] BF16.

What one GPU allows (the test checks whichever happens, with real
assertions either way):
  - backend='nccl': NCCL refuses two ranks on one device. If the group forms
    anyway (a future NCCL), the gathered bytes of every rank must equal the
    CPU reference's quantization of the concatenation.
  - backend='gloo': the group forms (the optimizer's sharded Step uses it on
    one GPU, with host staging), but AllGather on a CUDA qtxd needs a
    communicator that moves device memory (server/ops/allgather.cc): every
    rank's call must fail with FAILED_PRECONDITION naming that, not hang and
    not write wrong bytes. If it gathers, the bytes are checked as above.
The multi-rank path itself is covered on the CPU by tests/python/test_package.py
(qtx.Client, two and three CPU qtxd).

  python3 tests/python/gpu_test_allgather_ranks.py --qtxd=build/server/qtxd \
      --python_dir=build/client/python
"""

import argparse
import os
import signal
import sys
import tempfile
import threading
import unittest

import numpy as np

import qtxd_child

ARGS = None
qtx = qcuda = torch = None
SERVERS = {}
PROCS = []
ROWS = (300, 257)
N = 512


def serving(target):
    """qtxd_child's probe: the C++ client's health check (no grpcio needed)."""
    return qcuda._native.Session(target, "host", "probe", 2.0).health() == "SERVING"


def start_qtxd(name, extra):
    """A qtxd named `name` (its log in the test's temporary folder), once
    SERVING; stopped by tearDownModule, killed with the test process."""
    child = qtxd_child.start(ARGS.qtxd, SERVERS["tmp"], extra, probe=serving, name=name,
                             timeout=60, log=os.path.join(SERVERS["tmp"], name + ".log"))
    PROCS.append(child)
    return child.target


def setUpModule():
    global qtx, qcuda, torch
    sys.path.insert(0, ARGS.python_dir)
    import qtx as _qtx
    import qtx.cuda as _qcuda
    import torch as _torch
    qtx, qcuda, torch = _qtx, _qcuda, _torch
    SERVERS["tmp"] = tempfile.mkdtemp(prefix="qtx-py2r-")
    SERVERS["ranks"] = [start_qtxd("rank%d" % r, ["--device=cuda:0", "--allow_client_shm"])
                        for r in range(2)]
    SERVERS["ref"] = qcuda._native.Session(start_qtxd("cpu", ["--device=cpu"]), "host", "ref",
                                           60.0)


def tearDownModule():
    for child in PROCS:
        child.stop(timeout=10)


def host_bytes(t):
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.cpu().numpy().tobytes()


def reference(x):
    r = SERVERS["ref"].quantize_host(host_bytes(x), 2, list(x.shape), 1, 1, True, True, True, 0.0)
    return {k: bytes(v[0]) for k, v in r.items()}


def on_ranks(fn, timeout=90):
    """fn(rank, session) on one thread per rank: results or exceptions."""
    out = [None, None]

    def run(r):
        try:
            out[r] = fn(r, SESSIONS[r])
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise AssertionError("a rank did not return within %d s (hung collective)" % timeout)
    return out


SESSIONS = []


class TwoRanksOneGpuTest(unittest.TestCase):
    def setUp(self):
        SESSIONS[:] = [qcuda.Session(t, label="rank%d" % r, timeout=30.0)
                       for r, t in enumerate(SERVERS["ranks"])]
        g = torch.Generator(device="cpu").manual_seed(11)
        self.x = [(torch.randn(m, N, generator=g) * (4.0 if r else 0.25)).to(torch.bfloat16)
                  .cuda() for r, m in enumerate(ROWS)]
        self.ref = reference(torch.cat(self.x))

    def tearDown(self):
        for s in SESSIONS:
            try:
                s.close()
            except qtx.errors.QtxError as e:
                print("close: %r" % e, file=sys.stderr)

    def create(self, name, backend):
        return on_ranks(lambda r, s: s.create_group(
            name, r, 2, coordinator="" if r == 0 else SERVERS["ranks"][0], backend=backend,
            timeout=20.0))

    def gather(self, name):
        def run(r, s):
            q = s.all_gather(self.x[r], name, 0, columnwise=True, shard_rows=list(ROWS),
                             async_op=False)
            s.synchronize()
            return q
        return on_ranks(run)

    def check_bytes(self, results, label):
        for r, q in enumerate(results):
            self.assertEqual(q.shape, (sum(ROWS), N))
            for f, want in self.ref.items():
                got = host_bytes(getattr(q, f))
                if got != want:
                    a, b = np.frombuffer(got, np.uint8), np.frombuffer(want, np.uint8)
                    self.fail("%s rank %d: %s differs from the CPU reference (%d of %d bytes)"
                              % (label, r, f, int(np.count_nonzero(a != b)), b.size))

    def test_nccl_two_ranks_one_gpu(self):
        infos = self.create("py-2r-nccl", "nccl")
        errs = [i for i in infos if isinstance(i, Exception)]
        if not errs:
            print("NCCL formed a two-rank group on one GPU: checking the gather",
                  file=sys.stderr)
            res = self.gather("py-2r-nccl")
            for r in res:
                self.assertNotIsInstance(r, Exception, msg=str(r))
            self.check_bytes(res, "nccl")
            return
        for e in errs:
            print("nccl group on one GPU refused: %r" % e, file=sys.stderr)
            self.assertIsInstance(e, qtx.errors.QtxError)
        self.assertTrue(any(isinstance(i, Exception) for i in infos))

    def test_gloo_two_ranks_one_gpu(self):
        infos = self.create("py-2r-gloo", "gloo")
        for i in infos:
            self.assertNotIsInstance(i, Exception, msg="a Gloo group of two CUDA qtxd: %r" % (i,))
            self.assertEqual(i[1], 2)  # (rank, world_size, next_sequence)
        res = self.gather("py-2r-gloo")
        if not any(isinstance(r, Exception) for r in res):
            print("Gloo gathered on CUDA qtxd: checking the bytes", file=sys.stderr)
            self.check_bytes(res, "gloo")
            return
        for r, e in enumerate(res):
            print("gloo all_gather rank %d: %r" % (r, e), file=sys.stderr)
            self.assertIsInstance(e, qtx.errors.FailedPreconditionError, msg=repr(e))
            self.assertIn("cannot move the memory of device cuda:0", e.message)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--qtxd", required=True)
    p.add_argument("--python_dir", required=True)
    ARGS, rest = p.parse_known_args()

    def on_term(*_):
        tearDownModule()
        os._exit(1)

    signal.signal(signal.SIGTERM, on_term)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
