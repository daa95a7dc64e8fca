"""Test helpers: quantize through the qtx CLI (`qtx quantize --npy=... --save=PREFIX`)
against a qtxd, with .npy files read and written by hand (torch only; no numpy, no
gRPC), for hosts whose Python has no grpcio (the GPU machine's).

    with Qtxd(qtxd_path) as server:
        q = cli_quantize(cli_path, server.target, x, mode="1d", columnwise=True)
        q.rowwise_data, q.rowwise_scale_inv, ..., q.dequantized  (torch CPU tensors)
"""

import ast
import ctypes
import os
import shutil
import struct
import subprocess
import tempfile
import time

import torch

import qtxd_child

_NPY_DTYPES = {"<f4": torch.float32, "<f2": torch.float16, "|u1": torch.uint8}
_NPY_DESCR = {v: k for k, v in _NPY_DTYPES.items()}


def write_npy(path, t):
    """Writes a CPU tensor (float32, float16 or uint8; any layout) as a version 1.0
    C-order .npy file."""
    t = t.detach().to("cpu").contiguous()
    header = "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }" % (
        _NPY_DESCR[t.dtype], "".join("%d," % d for d in t.shape))
    # magic (6) + version (2) + length (2) + header + '\n', padded to 64 bytes.
    pad = 64 - (10 + len(header) + 1) % 64
    header = header + " " * (pad % 64) + "\n"
    nbytes = t.numel() * t.element_size()
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("ascii"))
        if nbytes:
            f.write(ctypes.string_at(t.data_ptr(), nbytes))  # little-endian hosts only


def read_npy(path):
    """A CPU tensor of a .npy file written by write_npy or the qtx CLI."""
    with open(path, "rb") as f:
        blob = f.read()
    if blob[:6] != b"\x93NUMPY":
        raise ValueError("%s: not a .npy file" % path)
    major = blob[6]
    if major == 1:
        hlen, start = struct.unpack("<H", blob[8:10])[0], 10
    else:
        hlen, start = struct.unpack("<I", blob[8:12])[0], 12
    header = ast.literal_eval(blob[start:start + hlen].decode("latin1"))
    if header["fortran_order"]:
        raise ValueError("%s: fortran_order" % path)
    dtype = _NPY_DTYPES[header["descr"]]
    shape = tuple(header["shape"])
    data = bytearray(blob[start + hlen:])
    flat = torch.frombuffer(data, dtype=dtype) if len(data) else torch.empty(0, dtype=dtype)
    return flat.reshape(shape).clone()


class CliQuantized:
    """What cli_quantize returns: QuantizedTensor fields (torch CPU tensors) plus the
    server's FP32 dequantization (of the rowwise copy when present)."""

    def __init__(self, shape, mode, fmt):
        self.shape, self.mode, self.format = tuple(shape), mode, fmt
        self.rowwise_data = self.rowwise_scale_inv = None
        self.columnwise_data = self.columnwise_scale_inv = None
        self.dequantized = None


def cli_quantize(cli, target, x, mode="1d", fmt="e4m3", rowwise=True, columnwise=False,
                 workdir=None):
    """Quantizes the CPU float32 tensor x through `qtx quantize --save`."""
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="qtx-cli-")
    try:
        src = os.path.join(workdir, "x.npy")
        write_npy(src, x.float())
        prefix = os.path.join(workdir, "q")
        usages = ",".join(u for u, on in (("rowwise", rowwise), ("columnwise", columnwise)) if on)
        cmd = [cli, "quantize", "--target=" + target, "--npy=" + src, "--mode=" + mode,
               "--format=" + fmt, "--usages=" + usages, "--save=" + prefix]
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=300)
        if r.returncode != 0:
            raise RuntimeError("%s failed (%d): %s" % (" ".join(cmd), r.returncode,
                                                       r.stderr.decode(errors="replace")))
        q = CliQuantized(x.shape, mode, fmt)
        for field in ("rowwise_data", "rowwise_scale_inv", "columnwise_data",
                      "columnwise_scale_inv", "dequantized"):
            path = "%s.%s.npy" % (prefix, field)
            if os.path.exists(path):
                setattr(q, field, read_npy(path))
        return q
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


class Qtxd:
    """A qtxd on a temporary unix socket (SIGTERM on exit; raises if it exits
    non-zero)."""

    def __init__(self, qtxd, device="cpu", cli=None, extra=()):
        self.qtxd, self.device, self.cli, self.extra = qtxd, device, cli, list(extra)

    def __enter__(self):
        self.tmp = tempfile.mkdtemp(prefix="qtxd-")

        def ready(target):
            if self.cli is None:
                time.sleep(0.5)  # the socket file exists; no client to ask
                return True
            return subprocess.run([self.cli, "health", "--target=" + target],
                                  stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL).returncode == 0
        try:
            self.server = qtxd_child.start(self.qtxd, self.tmp,
                                           ["--device=" + self.device] + self.extra,
                                           probe=ready, timeout=60)
        except Exception:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        self.proc, self.target = self.server.proc, self.server.target
        return self

    def __exit__(self, *exc):
        try:
            code = self.server.stop()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if code != 0 and exc[0] is None:
            raise RuntimeError("qtxd exited with %d after SIGTERM" % code)
