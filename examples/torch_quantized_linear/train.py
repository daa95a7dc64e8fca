#!/usr/bin/env python3
"""A Linear layer whose input and weight are quantized by qtx and multiplied in FP8,
trained next to a BF16 baseline on the same data (examples/torch_quantized_linear/README.md).

    # inline path (any host, a CPU qtxd): qtx.Client, dequantize-then-matmul on the CPU
    /usr/bin/python3 examples/torch_quantized_linear/train.py --qtxd=build/server/qtxd \
        --python_dir=build/client/python --steps=300
    # GPU path: qtx.cuda.Session when the module is built, FP8 GEMMs on sm_90
    python3 examples/torch_quantized_linear/train.py --target=unix:///tmp/qtxd.sock --device=cuda

Forward Y = X W^T + b with X quantized 1x128 (mode '1d') and W 128x128 (mode '2d'), E4M3;
backward dX = dY W (dY 1x128 x W's columnwise copy) and dW = dY^T X (1x128 x 1x128
columnwise copies) — the three GEMMs of TransformerEngine's Float8BlockScaling recipe,
through qtx.torch_fp8.matmul: PyTorch's block-scaled FP8 GEMM where it can run (CUDA,
sm_90, torch >= 2.10), dequantize-then-matmul elsewhere (the path taken is printed).
Gradients are E4M3 too: PyTorch's block-scaled GEMM takes e4m3 x e4m3 only (TE's HYBRID
format would use E5M2 for them).

Both models start from the same weights, see the same batches and use torch.optim.AdamW;
the baseline runs its Linear layers in BF16 (F.linear on BF16 copies of FP32 masters).
Prints one JSON line per logged step and a summary line; --check fails (exit 1) unless the
final qtx-FP8 loss is within --tolerance of the BF16 one and below --max_final_ratio of
the initial loss.
"""

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
TF = None  # qtx.torch_fp8


def load_torch_fp8():
    try:
        from qtx import torch_fp8
        return torch_fp8
    except ImportError:  # the qtx package needs grpcio; torch_fp8 alone needs only torch
        path = os.path.join(ROOT, "client", "python", "qtx", "torch_fp8.py")
        spec = importlib.util.spec_from_file_location("qtx_torch_fp8", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


class Quantizer:
    """qtx.cuda.Session (device tensors in, device tensors out) when the module is
    there, else qtx.Client (inline: the tensor goes to qtxd and back as CPU tensors,
    which are then moved to the model's device). 'cli' quantizes through the qtx CLI
    (a process per call; for hosts whose Python has no grpcio — testing only)."""

    def __init__(self, kind, target, cli=None, device="cpu"):
        self.kind = kind
        self.calls = 0
        # qtx.cuda takes device tensors only: on a CPU run "auto" skips it.
        if kind == "cuda" or (kind == "auto" and str(device).startswith("cuda")):
            try:
                import qtx.cuda as qtx_cuda
                self.impl = qtx_cuda.Session(target=target)
                self.kind = "qtx.cuda.Session"
                return
            except ImportError:
                if kind == "cuda":
                    raise
        if kind in ("auto", "client"):
            import qtx
            self.impl = qtx.Client(target)
            self.kind = "qtx.Client (inline)"
            return
        if kind == "cli":
            sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
            import qtx_cli_io
            self.impl = None
            self.cli_io, self.cli, self.target = qtx_cli_io, cli, target
            self.kind = "qtx CLI (testing)"
            return
        raise ValueError("quantizer=%r" % kind)

    def quantize(self, x, mode, columnwise):
        self.calls += 1
        x = x.detach().float().contiguous()
        if self.impl is None:
            q = self.cli_io.cli_quantize(self.cli, self.target, x.cpu(), mode, rowwise=True,
                                         columnwise=columnwise)
        else:
            q = self.impl.quantize(x, mode=mode, format="e4m3", rowwise=True,
                                   columnwise=columnwise)
        if q.rowwise_data.device != x.device:
            q = TF.to_device(q, x.device)
        return q


class QuantizedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        qx = layer.quantizer.quantize(x, "1d", columnwise=True)
        qw = layer.quantizer.quantize(weight, "2d", columnwise=True)
        y, path = TF.matmul(qx, qw, torch.bfloat16)
        layer.paths.add("fprop: " + path)
        ctx.saved = (qx, qw, layer)
        return y.float() + bias

    @staticmethod
    def backward(ctx, grad_y):
        qx, qw, layer = ctx.saved
        qdy = layer.quantizer.quantize(grad_y, "1d", columnwise=True)
        dx, p1 = TF.matmul(qdy, qw, torch.bfloat16, b_usage="columnwise")   # dY W
        dw, p2 = TF.matmul(qdy, qx, torch.float32, "columnwise", "columnwise")  # dY^T X
        layer.paths.add("dgrad: " + p1)
        layer.paths.add("wgrad: " + p2)
        return dx.float(), dw, grad_y.sum(0), None


class QuantizedLinear(torch.nn.Module):
    def __init__(self, linear, quantizer):
        super().__init__()
        self.weight = torch.nn.Parameter(linear.weight.detach().clone())
        self.bias = torch.nn.Parameter(linear.bias.detach().clone())
        self.quantizer = quantizer
        self.paths = set()

    def forward(self, x):
        return QuantizedLinearFn.apply(x, self.weight, self.bias, self)


class Bf16Linear(torch.nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.weight = torch.nn.Parameter(linear.weight.detach().clone())
        self.bias = torch.nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        return torch.nn.functional.linear(x.bfloat16(), self.weight.bfloat16(),
                                          self.bias.bfloat16()).float()


def build(args, quantizer):
    torch.manual_seed(args.seed)
    l1 = torch.nn.Linear(args.d_in, args.d_hidden)
    l2 = torch.nn.Linear(args.d_hidden, args.d_out)
    fp8 = torch.nn.Sequential(QuantizedLinear(l1, quantizer), torch.nn.GELU(),
                              QuantizedLinear(l2, quantizer)).to(args.device)
    bf16 = torch.nn.Sequential(Bf16Linear(l1), torch.nn.GELU(), Bf16Linear(l2)).to(args.device)
    return fp8, bf16


def data(args):
    """A fixed random teacher (tanh MLP) plus noise; batches drawn from a seeded stream."""
    g = torch.Generator().manual_seed(args.seed + 1)
    t1 = torch.randn(args.d_in, 384, generator=g) / args.d_in ** 0.5
    t2 = torch.randn(384, args.d_out, generator=g) / 384 ** 0.5

    def batch(n):
        x = torch.randn(n, args.d_in, generator=g)
        y = torch.tanh(x @ t1) @ t2 + 0.01 * torch.randn(n, args.d_out, generator=g)
        return x.to(args.device), y.to(args.device)
    return batch


class LocalQtxd:
    def __init__(self, path):
        self.tmp = tempfile.mkdtemp(prefix="qtx-example-")
        sock = os.path.join(self.tmp, "qtxd.sock")
        self.target = "unix://" + sock
        self.proc = subprocess.Popen([path, "--socket=" + sock, "--device=cpu",
                                      "--log_level=warn"])
        deadline = time.time() + 30
        while not os.path.exists(sock):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("qtxd did not start")
            time.sleep(0.05)
        time.sleep(0.2)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            shutil.rmtree(self.tmp, ignore_errors=True)
        return self.proc.returncode


def main():
    global TF
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--qtxd", default="", help="start this qtxd (CPU device) for the run")
    p.add_argument("--target", default="unix:///tmp/qtxd.sock", help="else use this qtxd")
    p.add_argument("--python_dir", default="", help="folder of the qtx package (build dir)")
    p.add_argument("--quantizer", default="auto", choices=("auto", "cuda", "client", "cli"))
    p.add_argument("--qtx_cli", default="", help="the qtx CLI, for --quantizer=cli")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--log_every", type=int, default=25)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--d_in", type=int, default=256)
    p.add_argument("--d_hidden", type=int, default=512)
    p.add_argument("--d_out", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--json", default="", help="also append the JSON lines to this file")
    p.add_argument("--check", action="store_true")
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--max_final_ratio", type=float, default=0.5)
    args = p.parse_args()
    if args.python_dir:
        sys.path.insert(0, args.python_dir)
    if args.threads:
        torch.set_num_threads(args.threads)
    TF = load_torch_fp8()
    server = LocalQtxd(args.qtxd) if args.qtxd else None
    target = server.target if server else args.target
    out = open(args.json, "a") if args.json else None

    def emit(row):
        line = json.dumps(row)
        print(line, flush=True)
        if out:
            out.write(line + "\n")

    try:
        quantizer = Quantizer(args.quantizer, target, args.qtx_cli, args.device)
        fp8, bf16 = build(args, quantizer)
        opt8 = torch.optim.AdamW(fp8.parameters(), lr=args.lr)
        opt16 = torch.optim.AdamW(bf16.parameters(), lr=args.lr)
        batch = data(args)
        x_eval, y_eval = batch(args.batch)
        emit(dict(config=dict(vars(args)), quantizer=quantizer.kind, torch=torch.__version__,
                  device=str(args.device)))
        first = last = None
        t0 = time.time()
        for step in range(args.steps + 1):
            x, y = batch(args.batch)
            losses = []
            for model, opt in ((fp8, opt8), (bf16, opt16)):
                loss = torch.nn.functional.mse_loss(model(x), y)
                if step < args.steps:
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                losses.append(loss.item())
            if step % args.log_every == 0 or step == args.steps:
                with torch.no_grad():
                    ev = [torch.nn.functional.mse_loss(m(x_eval), y_eval).item()
                          for m in (fp8, bf16)]
                row = dict(step=step, train_loss_qtx_fp8=losses[0], train_loss_bf16=losses[1],
                           eval_loss_qtx_fp8=ev[0], eval_loss_bf16=ev[1],
                           ratio=ev[0] / ev[1], seconds=round(time.time() - t0, 2))
                emit(row)
                first = first or row
                last = row
        paths = sorted(set().union(*(m.paths for m in fp8 if isinstance(m, QuantizedLinear))))
        ok = (abs(last["ratio"] - 1) <= args.tolerance
              and last["eval_loss_qtx_fp8"] <= args.max_final_ratio * first["eval_loss_qtx_fp8"])
        emit(dict(summary=True, steps=args.steps, quantizer=quantizer.kind,
                  quantize_calls=quantizer.calls, gemm_paths=paths,
                  initial_eval_loss=first["eval_loss_qtx_fp8"],
                  final_eval_loss_qtx_fp8=last["eval_loss_qtx_fp8"],
                  final_eval_loss_bf16=last["eval_loss_bf16"], final_ratio=last["ratio"],
                  check_ok=ok))
        if args.check and not ok:
            print("check failed: final ratio %.4f (tolerance %.3f), final/initial %.3f (max %.2f)"
                  % (last["ratio"], args.tolerance,
                     last["eval_loss_qtx_fp8"] / first["eval_loss_qtx_fp8"],
                     args.max_final_ratio), file=sys.stderr)
            return 1
        return 0
    finally:
        if out:
            out.close()
        if server and server.stop() != 0:
            print("qtxd exited non-zero", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
