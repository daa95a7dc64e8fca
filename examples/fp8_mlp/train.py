#!/usr/bin/python3
"""Train a small MLP whose weights live as FP8 BLOCK_2D parameters from qtx and
whose AdamW lives in qtxd, next to an FP32 baseline trained the same way.

Both runs use the same data, initialization, hyper-parameters and the same
optimizer (AdamW in qtxd, bit-exact with torch.optim.AdamW's operation order):

* ``fp8``: the training process holds only FP8 parameters from Step (E4M3
  data, FP32 128x128-tile scales) and its gradients. The forward pass
  multiplies with the dequantized *rowwise* copy, the backward pass
  (dX = dY @ W) with the dequantized *columnwise* copy, as an FP8 GEMM would.
  FP32 master weights and both moments stay in qtxd. With ``--hold=rowwise``
  (the default) the process keeps only the rowwise copy and makes the
  columnwise one from it when the backward pass needs it (the byte transpose
  of docs/numerics.md §4.5, what qtx::cuda::MakeColumnwiseCopy does on a GPU);
  every step checks that the made copy equals the columnwise copy Step
  returned, byte for byte. ``--hold=both`` keeps both copies.
* ``fp32``: the forward and backward use the FP32 master weights (fetched with
  GetState after each step) — a plain FP32 training run with the same AdamW.

The task is a synthetic regression: a random teacher MLP (tanh hidden layer)
maps x ~ N(0, I) to y; the student has the same shape. Loss: mean squared
error. Everything is numpy (FP32) on the CPU; the FP8 decode is independent of
qtx (a table of the 256 E4M3 values).

Prints the loss curves as a table, writes JSON (--json) and a Markdown report
(--markdown) with the curves and the bytes per parameter held by the training
process vs BF16 mixed precision. With --check, exits 1 unless the final FP8
loss is within --tolerance (relative) of the FP32 one and below
--max_final_ratio x the initial loss.

  /usr/bin/python3 examples/fp8_mlp/train.py --qtxd=build/server/qtxd \\
      --python_dir=build/client/python --steps=300
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

qtx = None  # the generated package, imported in main()


# ---------------------------------------------------------------- FP8 decode

def e4m3_table():
    """The 256 E4M3 ("fn": no Inf, 0x7F/0xFF NaN) values, by byte."""
    t = np.zeros(256, dtype=np.float32)
    for b in range(256):
        sign = -1.0 if b & 0x80 else 1.0
        e = (b >> 3) & 0xF
        m = b & 0x7
        if e == 0xF and m == 0x7:
            t[b] = np.nan
        elif e == 0:
            t[b] = sign * (m / 8.0) * 2.0 ** -6
        else:
            t[b] = sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)
    return t


E4M3 = e4m3_table()


def decode_2d(data, scale_inv, rows, cols):
    """Dequantizes a BLOCK_2D copy: data [rows, cols] bytes, scale_inv
    [ceil(rows/128), pad4(ceil(cols/128))] FP32 (docs/numerics.md §4)."""
    q = E4M3[np.frombuffer(data, dtype=np.uint8).reshape(rows, cols)]
    s = np.frombuffer(scale_inv, dtype=np.float32).reshape(-1, scale_inv_cols(cols))
    s = s[:, : (cols + 127) // 128]
    s_full = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:rows, :cols]
    return q * s_full


def columnwise_from_rowwise(data, scale_inv, rows, cols):
    """The BLOCK_2D columnwise copy made from the rowwise one (docs/numerics.md
    §4.5): data transposed to [cols, rows], the tile scales transposed to
    [ceil(cols/128), pad4(ceil(rows/128))] with zero padding."""
    q = np.frombuffer(data, dtype=np.uint8).reshape(rows, cols).T
    mb, nb = (rows + 127) // 128, (cols + 127) // 128
    s = np.frombuffer(scale_inv, dtype=np.float32).reshape(mb, scale_inv_cols(cols))
    sc = np.zeros((nb, scale_inv_cols(rows)), dtype=np.float32)
    sc[:, :mb] = s[:, :nb].T
    return np.ascontiguousarray(q).tobytes(), sc.tobytes()


def scale_inv_cols(cols):
    blocks = (cols + 127) // 128
    return (blocks + 3) // 4 * 4


# ---------------------------------------------------------------- qtxd

def start_qtxd(qtxd, tmp, threads):
    sock = os.path.join(tmp, "qtxd.sock")
    args = [qtxd, "--socket=" + sock, "--device=cpu", "--log_level=warn"]
    if threads:
        args.append("--optimizer_threads=%d" % threads)
    proc = subprocess.Popen(args)
    target = "unix://" + sock
    deadline = time.time() + 30
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("qtxd exited with %d during startup" % proc.returncode)
        if os.path.exists(sock):
            try:
                with qtx.channel(target) as ch:
                    qtx.v1.optimizer_pb2_grpc.OptimizerStub(ch).ListGroups(
                        qtx.v1.optimizer_pb2.ListOptimizerGroupsRequest(), timeout=2)
                return proc, target
            except Exception:  # not up yet
                pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("qtxd did not answer within 30 s")


def stop_qtxd(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


def f32_ref(a):
    a = np.ascontiguousarray(a, dtype=np.float32)
    return qtx.v1.tensor_pb2.TensorRef(dtype=qtx.v1.tensor_pb2.FLOAT32, shape=list(a.shape),
                                       inline_data=a.tobytes())


class OffloadedParams:
    """A parameter group in qtxd; the process keeps what Step returns."""

    def __init__(self, channel, group, init, args, fp8):
        self.o = qtx.v1.optimizer_pb2
        self.channel = channel
        self.stub = qtx.v1.optimizer_pb2_grpc.OptimizerStub(channel)
        self.group = group
        self.fp8 = fp8
        self.hold = args.hold
        self.columnwise_checked = 0  # made columnwise copies equal to Step's
        self.shapes = {n: p.shape for n, p in init.items()}
        req = self.o.OffloadOptimizerStateRequest(group=group)
        h = req.hyper_params
        h.lr, h.beta1, h.beta2, h.eps, h.weight_decay = (args.lr, 0.9, 0.999, 1e-8,
                                                         args.weight_decay)
        # FP8 BLOCK_2D (128x128, E4M3, rowwise + columnwise) is the default.
        for n, p in init.items():
            req.parameters.add(name=n, shape=list(p.shape), master=f32_ref(p))
        self.stub.OffloadOptimizerState(req, timeout=60)
        self.step_no = 0
        self.held = {}  # what the training process holds between steps
        if fp8:
            self._keep_fp8(self._step_outputs(None))
        else:
            self.held = {n: p.astype(np.float32).copy() for n, p in init.items()}

    def _step_outputs(self, grads):
        """Steps with `grads` and returns the FP8 outputs by name. grads None:
        the FP8 copies of the initial masters, from the Quantizer service (the
        same bytes a Step returns for unchanged masters)."""
        if grads is None:
            qs = qtx.v1.quantizer_pb2
            qstub = qtx.v1.quantizer_pb2_grpc.QuantizerStub(self.channel)
            outs = {}
            st = self.stub.GetState(self.o.GetStateRequest(group=self.group), timeout=60)
            for p in st.parameters:
                m = np.frombuffer(p.master.inline_data, dtype=np.float32).reshape(
                    tuple(p.master.shape))
                r = qstub.Quantize(qs.QuantizeRequest(
                    input=f32_ref(m.reshape(-1, m.shape[-1])),
                    config=qs.QuantizeConfig(scaling_mode=qs.BLOCK_2D, rowwise=True,
                                             columnwise=True)), timeout=60).result
                outs[p.name] = r
            return outs
        self.step_no += 1
        req = self.o.StepRequest(group=self.group, step=self.step_no,
                                 omit_parameters=not self.fp8)
        for n, g in grads.items():
            req.gradients.add(name=n, grad=f32_ref(g))
        resp = self.stub.Step(req, timeout=60)
        return {p.name: p.fp8 for p in resp.parameters}

    def _keep_fp8(self, outs):
        self.held = {}
        for n, q in outs.items():
            shape = self.shapes[n]
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            cols = shape[-1]
            row = (q.rowwise_data.inline_data, q.rowwise_scale_inv.inline_data)
            col = (q.columnwise_data.inline_data, q.columnwise_scale_inv.inline_data)
            if self.hold == "rowwise":
                made = columnwise_from_rowwise(*row, rows, cols)
                if made != col:
                    raise RuntimeError("%s: the columnwise copy made from the rowwise one differs "
                                       "from Step's columnwise copy" % n)
                self.columnwise_checked += 1
                self.held[n] = {"row": row, "rows": rows, "cols": cols}  # Step's col dropped
            else:
                self.held[n] = {"row": row, "col": col, "rows": rows, "cols": cols}

    def weights(self):
        """(forward weights, backward weights) per parameter, FP32 arrays."""
        if not self.fp8:
            return self.held, self.held
        fwd, bwd = {}, {}
        for n, h in self.held.items():
            r, c = h["rows"], h["cols"]
            fwd[n] = decode_2d(*h["row"], r, c).reshape(self.shapes[n])
            # --hold=rowwise: the columnwise copy is made here, used, and dropped.
            col = h["col"] if "col" in h else columnwise_from_rowwise(*h["row"], r, c)
            bwd[n] = decode_2d(*col, c, r).T.reshape(self.shapes[n])
        return fwd, bwd

    def step(self, grads):
        outs = self._step_outputs(grads)
        if self.fp8:
            self._keep_fp8(outs)
        else:
            st = self.stub.GetState(self.o.GetStateRequest(group=self.group), timeout=60)
            self.held = {p.name: np.frombuffer(p.master.inline_data, dtype=np.float32).reshape(
                tuple(p.master.shape)).copy() for p in st.parameters}

    def held_bytes(self):
        """Bytes of parameters the training process holds (no gradients)."""
        if not self.fp8:
            return sum(a.nbytes for a in self.held.values())
        return sum(sum(len(b) for b in h["row"] + h.get("col", ())) for h in self.held.values())


# ---------------------------------------------------------------- model

def make_task(args):
    rng = np.random.default_rng(args.seed)
    d, h = args.d_in, args.hidden
    a = rng.standard_normal((h, d)).astype(np.float32) / np.sqrt(d)
    b = rng.standard_normal((args.d_out, h)).astype(np.float32) / np.sqrt(h)

    def batch(k):
        r = np.random.default_rng(args.seed * 1000003 + k)
        x = r.standard_normal((args.batch, d)).astype(np.float32)
        y = np.tanh(x @ a.T * 2.0) @ b.T
        return x, y.astype(np.float32)

    init = {
        "w1": (rng.standard_normal((h, d)) / np.sqrt(d)).astype(np.float32),
        "b1": np.zeros(h, dtype=np.float32),
        "w2": (rng.standard_normal((args.d_out, h)) / np.sqrt(h)).astype(np.float32),
        "b2": np.zeros(args.d_out, dtype=np.float32),
    }
    return batch, init


def forward_backward(fwd, bwd, x, y):
    """MSE loss of tanh-MLP and its gradients (FP32)."""
    z = x @ fwd["w1"].T + fwd["b1"]
    a = np.tanh(z)
    out = a @ fwd["w2"].T + fwd["b2"]
    diff = out - y
    loss = float(np.mean(diff * diff))
    dout = (2.0 / diff.size) * diff
    g = {"w2": dout.T @ a, "b2": dout.sum(axis=0)}
    da = dout @ bwd["w2"]
    dz = da * (1.0 - a * a)
    g["w1"] = dz.T @ x
    g["b1"] = dz.sum(axis=0)
    return loss, {k: v.astype(np.float32) for k, v in g.items()}


def eval_loss(fwd, batch, args):
    x, y = batch(10 ** 6)  # a held-out batch
    z = np.tanh(x @ fwd["w1"].T + fwd["b1"])
    out = z @ fwd["w2"].T + fwd["b2"]
    return float(np.mean((out - y) ** 2))


def train(channel, group, fp8, batch, init, args):
    params = OffloadedParams(channel, group, init, args, fp8)
    curve = []
    fwd, bwd = params.weights()
    for step in range(args.steps + 1):
        x, y = batch(step)
        loss, grads = forward_backward(fwd, bwd, x, y)
        if step % args.log_every == 0 or step == args.steps:
            curve.append({"step": step, "train_loss": loss, "eval_loss": eval_loss(fwd, batch,
                                                                                   args)})
        if step == args.steps:
            break
        params.step(grads)
        fwd, bwd = params.weights()
    grad_bytes = sum(g.nbytes for g in grads.values())
    if fp8 and args.hold == "rowwise":
        print("made the columnwise copy from the rowwise one %d times, each equal to Step's" %
              params.columnwise_checked)
    return curve, params.held_bytes(), grad_bytes


# ---------------------------------------------------------------- report

def bytes_report(init, hold):
    """Bytes per parameter held by the training process, from the layouts;
    the first row is what this run's FP8 process holds (--hold)."""
    n_params = sum(p.size for p in init.values())
    row_bytes = col_bytes = 0
    for p in init.values():
        rows = int(np.prod(p.shape[:-1])) if p.ndim > 1 else 1
        cols = p.shape[-1]
        row_bytes += rows * cols + 4 * ((rows + 127) // 128) * scale_inv_cols(cols)
        col_bytes += rows * cols + 4 * ((cols + 127) // 128) * scale_inv_cols(rows)
    held = [
        ("qtx FP8 params (rowwise data + scales; columnwise made when needed), BF16 grads",
         row_bytes, 2 * n_params),
        ("qtx FP8 params (row+col data + scales), BF16 grads", row_bytes + col_bytes,
         2 * n_params),
    ]
    if hold == "both":
        held.reverse()
    rows = held + [
        ("qtx FP8 params (row+col data + scales), FP32 grads", row_bytes + col_bytes,
         4 * n_params),
        ("BF16 mixed precision: BF16 params + FP32 master + 2 FP32 moments, BF16 grads",
         (2 + 4 + 8) * n_params, 2 * n_params),
        ("BF16 mixed precision: BF16 params + FP32 master + 2 FP32 moments, FP32 grads",
         (2 + 4 + 8) * n_params, 4 * n_params),
    ]
    return n_params, [{"setup": s, "param_state_bytes": b, "grad_bytes": g,
                       "bytes_per_param": (b + g) / n_params} for s, b, g in rows]


def markdown(args, curves, report, n_params, measured):
    lines = ["| step | FP32 train loss | FP8 (qtx) train loss | FP32 eval loss | FP8 (qtx) eval loss |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for a, b in zip(curves["fp32"], curves["fp8"]):
        lines.append("| %d | %.5f | %.5f | %.5f | %.5f |" % (
            a["step"], a["train_loss"], b["train_loss"], a["eval_loss"], b["eval_loss"]))
    lines += ["", "Bytes per parameter held by the training process (%d parameters; "
              "the FP32 master weights and both AdamW moments, 12 B/param, live in qtxd):"
              % n_params, "",
              "| setup | bytes/param |", "| --- | ---: |"]
    for r in report:
        lines.append("| %s | %.4f |" % (r["setup"], r["bytes_per_param"]))
    lines += ["", "Measured in this run: the FP8 process held %d bytes of parameters "
              "(%.4f B/param) plus %d bytes of FP32 gradients." % (
                  measured["fp8_param_bytes"], measured["fp8_param_bytes"] / n_params,
                  measured["grad_bytes"])]
    return "\n".join(lines) + "\n"


def main():
    global qtx
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--qtxd", required=True, help="path to the qtxd binary (started here)")
    p.add_argument("--python_dir", required=True, help="build/client/python")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--log_every", type=int, default=25)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--d_in", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--d_out", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="qtxd --optimizer_threads")
    p.add_argument("--hold", choices=("rowwise", "both"), default="rowwise",
                   help="FP8 copies the training process keeps between steps")
    p.add_argument("--json", help="write the curves and the report here")
    p.add_argument("--markdown", help="write the Markdown tables here")
    p.add_argument("--check", action="store_true")
    p.add_argument("--tolerance", type=float, default=0.10,
                   help="--check: |fp8 - fp32| / fp32 of the final eval loss")
    p.add_argument("--max_final_ratio", type=float, default=0.5,
                   help="--check: final FP8 eval loss / initial eval loss")
    args = p.parse_args()
    sys.path.insert(0, args.python_dir)
    import qtx as qtx_pkg
    import qtx.v1.optimizer_pb2  # noqa: F401
    import qtx.v1.optimizer_pb2_grpc  # noqa: F401
    qtx = qtx_pkg

    batch, init = make_task(args)
    tmp = tempfile.mkdtemp(prefix="qtx-mlp-")
    proc, target = start_qtxd(args.qtxd, tmp, args.threads)
    curves = {}
    try:
        with qtx.channel(target) as ch:
            t0 = time.time()
            curves["fp32"], _, _ = train(ch, "mlp_fp32", False, batch, init, args)
            t1 = time.time()
            curves["fp8"], fp8_bytes, grad_bytes = train(ch, "mlp_fp8", True, batch, init, args)
            t2 = time.time()
    finally:
        code = stop_qtxd(proc)
    if code != 0:
        print("qtxd exited with %d" % code, file=sys.stderr)
        return 1
    n_params, report = bytes_report(init, args.hold)
    measured = {"fp8_param_bytes": fp8_bytes, "grad_bytes": grad_bytes}
    print("%6s %12s %12s %12s %12s" % ("step", "fp32_train", "fp8_train", "fp32_eval",
                                        "fp8_eval"))
    for a, b in zip(curves["fp32"], curves["fp8"]):
        print("%6d %12.5f %12.5f %12.5f %12.5f" % (a["step"], a["train_loss"], b["train_loss"],
                                                  a["eval_loss"], b["eval_loss"]))
    print("params=%d  seconds: fp32 %.1f, fp8 %.1f" % (n_params, t1 - t0, t2 - t1))
    for r in report:
        print("%8.4f B/param  %s" % (r["bytes_per_param"], r["setup"]))
    print("measured: fp8 params held %d B (%.4f B/param)" % (fp8_bytes, fp8_bytes / n_params))
    result = {"args": vars(args), "curves": curves, "n_params": n_params,
              "bytes_per_param": report, "measured": measured}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(args, curves, report, n_params, measured))
    # The held bytes must be what the layout formulas say.
    expected = report[0]["param_state_bytes"]
    if fp8_bytes != expected:
        print("FAIL: FP8 process holds %d bytes, the layouts say %d" % (fp8_bytes, expected))
        return 1
    if args.check:
        first, l32, l8 = (curves["fp8"][0]["eval_loss"], curves["fp32"][-1]["eval_loss"],
                          curves["fp8"][-1]["eval_loss"])
        if curves["fp32"][0]["eval_loss"] != first and abs(
                curves["fp32"][0]["eval_loss"] - first) > 0.05 * first:
            print("FAIL: initial losses differ too much: %g vs %g" % (
                curves["fp32"][0]["eval_loss"], first))
            return 1
        rel = abs(l8 - l32) / l32
        print("check: initial %.5f, final fp32 %.5f, final fp8 %.5f, rel diff %.4f "
              "(tolerance %.3f), final/initial %.4f (max %.3f)" % (
                  first, l32, l8, rel, args.tolerance, l8 / first, args.max_final_ratio))
        if rel > args.tolerance or l8 > args.max_final_ratio * first or not np.isfinite(l8):
            print("FAIL")
            return 1
        print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
