#!/usr/bin/python3
"""qtx.v1.Optimizer end to end through the generated Python stubs.

* AdamW in qtxd agrees with torch.optim.AdamW (Debian's python3-torch) within
  float rounding, over several steps, with weight decay and clipping;
* the FP8 parameters returned by Step equal Quantize(master weights fetched
  with GetState) byte for byte (the Quantizer service is the reference
  quantizer);
* a retried step is replayed, a step from the future fails FAILED_PRECONDITION;
* SIGTERM checkpoints; a second qtxd on the same --checkpoint_dir reports the
  step and continues byte-identically to a server that never restarted.

Skips (exit 0 with a message) when torch is not importable.

  /usr/bin/python3 tests/python/test_optimizer.py --qtxd=build/server/qtxd \
      --python_dir=build/client/python
"""

import argparse
import os
import shutil
import sys
import tempfile
import unittest

import numpy as np

import qtxd_child

ARGS = None
qtx = None
torch = None

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.1
SHAPES = {"w1": (200, 96), "b1": (200,), "w2": (10, 200)}


def start_server(tmp, extra):
    """A CPU qtxd on <tmp>/qtxd.sock, once its Optimizer service answers."""
    def ready(target):
        with qtx.channel(target) as ch:
            qtx.v1.optimizer_pb2_grpc.OptimizerStub(ch).ListGroups(
                qtx.v1.optimizer_pb2.ListOptimizerGroupsRequest(), timeout=2)
        return True
    return qtxd_child.start(ARGS.qtxd, tmp, ["--device=cpu"] + extra, probe=ready)


def tensor_f32(a):
    a = np.ascontiguousarray(a, dtype=np.float32)
    return qtx.v1.tensor_pb2.TensorRef(dtype=qtx.v1.tensor_pb2.FLOAT32, shape=list(a.shape),
                                       inline_data=a.tobytes())


class Client:
    def __init__(self, target):
        self.ch = qtx.channel(target)
        self.opt = qtx.v1.optimizer_pb2_grpc.OptimizerStub(self.ch)
        self.quant = qtx.v1.quantizer_pb2_grpc.QuantizerStub(self.ch)
        self.o = qtx.v1.optimizer_pb2

    def offload(self, params):
        req = self.o.OffloadOptimizerStateRequest(group="mlp")
        req.hyper_params.lr = LR
        req.hyper_params.beta1, req.hyper_params.beta2 = BETAS
        req.hyper_params.eps = EPS
        req.hyper_params.weight_decay = WD
        for name, p in params.items():
            req.parameters.add(name=name, shape=list(p.shape), master=tensor_f32(p))
        return self.opt.OffloadOptimizerState(req, timeout=60)

    def step(self, n, grads, max_grad_norm=None):
        req = self.o.StepRequest(group="mlp", step=n)
        if max_grad_norm is not None:
            req.max_grad_norm = max_grad_norm
        for name, g in grads.items():
            req.gradients.add(name=name, grad=tensor_f32(g))
        return self.opt.Step(req, timeout=60)

    def masters(self):
        st = self.opt.GetState(self.o.GetStateRequest(group="mlp", include_moments=True),
                               timeout=60)
        return {p.name: np.frombuffer(p.master.inline_data, dtype=np.float32).reshape(
            tuple(p.master.shape)) for p in st.parameters}, st

    def close(self):
        self.ch.close()


def fp8_bytes(out):
    q = out.fp8
    return (q.rowwise_data.inline_data, q.rowwise_scale_inv.inline_data,
            q.columnwise_data.inline_data, q.columnwise_scale_inv.inline_data)


class OptimizerTest(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="qtx-opt-")
        rng = np.random.default_rng(0)
        self.init = {n: (rng.standard_normal(s) * 0.1).astype(np.float32)
                     for n, s in SHAPES.items()}
        self.grads = [{n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
                      for _ in range(5)]

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def test_agrees_with_torch_and_survives_a_restart(self):
        # torch reference
        tparams = {n: torch.nn.Parameter(torch.from_numpy(p.copy())) for n, p in self.init.items()}
        topt = torch.optim.AdamW(list(tparams.values()), lr=LR, betas=BETAS, eps=EPS,
                                 weight_decay=WD)

        def torch_step(grads, max_norm=None):
            for n, p in tparams.items():
                p.grad = torch.from_numpy(grads[n].copy())
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(list(tparams.values()), max_norm)
            topt.step()

        dir_a = os.path.join(self.tmp, "a")
        dir_b = os.path.join(self.tmp, "b")
        os.mkdir(dir_a)
        os.mkdir(dir_b)
        ckpt = os.path.join(dir_a, "ckpt")
        server_a = start_server(dir_a, ["--checkpoint_dir=" + ckpt])
        server_b = start_server(dir_b, [])
        self.addCleanup(server_b.kill)  # when the test fails before it stops it
        a, b = Client(server_a.target), Client(server_b.target)
        try:
            a.offload(self.init)
            b.offload(self.init)
            for t in range(1, 4):
                clip = 1.0 if t == 2 else None
                ra = a.step(t, self.grads[t - 1], clip)
                rb = b.step(t, self.grads[t - 1], clip)
                torch_step(self.grads[t - 1], clip)
                self.assertEqual(ra.stats.step, t)
                self.assertFalse(ra.stats.skipped)
                if clip is not None:
                    self.assertLess(ra.stats.clip_coef, 1.0)
                for pa, pb in zip(ra.parameters, rb.parameters):
                    self.assertEqual(fp8_bytes(pa), fp8_bytes(pb))
                masters, _ = a.masters()
                for n, p in tparams.items():
                    np.testing.assert_allclose(masters[n], p.detach().numpy(), rtol=2e-6,
                                               atol=2e-7, err_msg="%s step %d" % (n, t))
            # FP8 output == Quantize(master) through the Quantizer service.
            masters, _ = a.masters()
            for out in ra.parameters:
                m = masters[out.name]
                m2 = m.reshape(-1, m.shape[-1])
                q = qtx.v1.quantizer_pb2
                qr = a.quant.Quantize(q.QuantizeRequest(
                    input=tensor_f32(m2),
                    config=q.QuantizeConfig(scaling_mode=q.BLOCK_2D, rowwise=True,
                                            columnwise=True)), timeout=60).result
                self.assertEqual(fp8_bytes(out), (qr.rowwise_data.inline_data,
                                                  qr.rowwise_scale_inv.inline_data,
                                                  qr.columnwise_data.inline_data,
                                                  qr.columnwise_scale_inv.inline_data), out.name)
            # Retry and out-of-order steps.
            again = a.step(3, self.grads[4])
            self.assertTrue(again.stats.replayed)
            self.assertEqual([fp8_bytes(p) for p in again.parameters],
                             [fp8_bytes(p) for p in ra.parameters])
            import grpc
            with self.assertRaises(grpc.RpcError) as e:
                a.step(5, self.grads[4])
            self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("at step 3", e.exception.details())
        finally:
            a.close()
            self.assertEqual(server_a.stop(), 0)
        self.assertTrue(os.path.exists(os.path.join(ckpt, "mlp.qtxopt")))
        # A second qtxd on the same checkpoint directory.
        server_a2 = start_server(dir_a, ["--checkpoint_dir=" + ckpt])
        a2 = Client(server_a2.target)
        try:
            groups = a2.opt.ListGroups(a2.o.ListOptimizerGroupsRequest(), timeout=10).groups
            self.assertEqual([(g.name, g.step, g.error) for g in groups], [("mlp", 3, "")])
            ra = a2.step(4, self.grads[3])
            rb = b.step(4, self.grads[3])
            torch_step(self.grads[3])
            for pa, pb in zip(ra.parameters, rb.parameters):
                self.assertEqual(fp8_bytes(pa), fp8_bytes(pb), pa.name)
            ma, _ = a2.masters()
            mb, _ = b.masters()
            for n in SHAPES:
                self.assertEqual(ma[n].tobytes(), mb[n].tobytes(), n)
                np.testing.assert_allclose(ma[n], tparams[n].detach().numpy(), rtol=2e-6,
                                           atol=2e-7)
        finally:
            a2.close()
            b.close()
            self.assertEqual(server_a2.stop(), 0)
            self.assertEqual(server_b.stop(), 0)

    def test_corrupted_checkpoint_is_refused(self):
        ckpt = os.path.join(self.tmp, "ckpt")
        server = start_server(self.tmp, ["--checkpoint_dir=" + ckpt])
        c = Client(server.target)
        c.offload(self.init)
        c.step(1, self.grads[0])
        c.close()
        self.assertEqual(server.stop(), 0)
        path = os.path.join(ckpt, "mlp.qtxopt")
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x40]))
        server = start_server(self.tmp, ["--checkpoint_dir=" + ckpt])
        c = Client(server.target)
        try:
            import grpc
            with self.assertRaises(grpc.RpcError) as e:
                c.step(2, self.grads[1])
            self.assertEqual(e.exception.code(), grpc.StatusCode.DATA_LOSS)
            self.assertIn("checksum", e.exception.details())
        finally:
            c.close()
            self.assertEqual(server.stop(), 0)


def main():
    global ARGS, qtx, torch
    parser = argparse.ArgumentParser()
    parser.add_argument("--qtxd", required=True)
    parser.add_argument("--python_dir", required=True)
    ARGS, rest = parser.parse_known_args()
    sys.path.insert(0, ARGS.python_dir)
    import qtx as qtx_pkg
    import qtx.v1.optimizer_pb2  # noqa: F401
    import qtx.v1.optimizer_pb2_grpc  # noqa: F401
    import qtx.v1.tensor_pb2  # noqa: F401
    qtx = qtx_pkg
    try:
        import torch as torch_mod
    except ImportError:
        print("SKIP: torch is not importable (Debian: apt-get install python3-torch)")
        sys.exit(77)
    torch = torch_mod
    torch.set_num_threads(1)
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)


if __name__ == "__main__":
    main()
