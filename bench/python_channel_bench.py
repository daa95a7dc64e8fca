#!/usr/bin/env python3
"""python_channel_bench: what qtx.cuda costs a PyTorch training process on one
GPU (issue "qtx from Python on the GPU"). Starts qtxd --device=cuda:0
--allow_client_shm and prints JSON lines:

  {"bench":"py_quantize_call", "out":"preallocated"|"pooled", ...}
      host time of one asynchronous Session.quantize from Python (p50/p99
      over the chain's calls); goal <= 30 us p50.
  {"bench":"py_channel_chain", "mode": ...}
      GPU time of `layers` x (a [m, k] BF16 1-D row+col quantize, then a
      [m x k] x [k x k] BF16 torch.matmul on the same stream that reads
      nothing from it), issued without host waits, for
        mode "matmul_only"      the matmuls alone (a lower bound),
        mode "qtx_preallocated" quantize into out= tensors,
        mode "qtx_pooled"       quantize into the session's pool;
      with ratio_vs_in_process when --in_process_jsonl names channel_bench's
      output of the same run (its "in_process" chain: the quantize kernel
      launched in-process by C++, the baseline of issue 12); goal <= 1.15x
      with MPS.

MPS is the caller's business (--mps only labels the lines).
  python3 bench/python_channel_bench.py --qtxd=PATH --python_dir=DIR [--layers=200]
      [--m=8192] [--k=4096] [--flags=host|device] [--mps=0|1] [--in_process_jsonl=FILE]
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))] if v else 0.0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--qtxd", required=True)
    p.add_argument("--python_dir", required=True)
    p.add_argument("--layers", type=int, default=200)
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--flags", default="host")
    p.add_argument("--mps", default="?")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--in_process_jsonl", default="")
    a = p.parse_args()
    sys.path.insert(0, a.python_dir)
    import torch
    import qtx.cuda as qcuda

    tmp = tempfile.mkdtemp(prefix="qtx-pybench-")
    sock = os.path.join(tmp, "qtxd.sock")
    server = subprocess.Popen([a.qtxd, "--socket=" + sock, "--device=cuda:0",
                               "--allow_client_shm", "--log_level=warn"])
    target = "unix://" + sock
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the finally below
    deadline = time.time() + 60
    while True:
        if server.poll() is not None:
            sys.exit("qtxd exited with status %s during startup" % server.returncode)
        try:
            if qcuda._native.Session(target, "host", "probe", 2.0).health() == "SERVING":
                break
        except Exception:  # noqa: BLE001 - not up yet
            pass
        if time.time() > deadline:
            server.terminate()
            sys.exit("qtxd did not become SERVING in 60 s")
        time.sleep(0.2)
    try:
        run(a, torch, qcuda, target)
    finally:
        server.terminate()
        server.wait(10)


def run(a, torch, qcuda, target):
    m, k, layers = a.m, a.k, a.layers
    stream = torch.cuda.Stream()
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ga = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    gb = torch.randn(k, k, device="cuda", dtype=torch.bfloat16)
    gc = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    lay = qcuda.layout((m, k))
    outs = {f: torch.empty(lay[f], dtype=torch.float32 if "scale" in f else torch.uint8,
                           device="cuda") for f in qcuda.FIELDS}
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    base = {"flags": a.flags, "mps": a.mps, "m": m, "k": k, "torch": torch.__version__}

    in_process_ms = None
    if a.in_process_jsonl and os.path.exists(a.in_process_jsonl):
        for line in open(a.in_process_jsonl):
            if line.startswith("{"):
                d = json.loads(line)
                if d.get("bench") == "channel_chain" and d.get("mode") == "in_process":
                    in_process_ms = d["gpu_ms"]

    with qcuda.Session(target, flag_memory=a.flags, label="bench") as s:
        calls = {"preallocated": [], "pooled": []}

        def chain(mode, record):
            stream.synchronize()
            with torch.cuda.stream(stream):
                t0.record()
                for _ in range(layers):
                    if mode != "matmul_only":
                        c0 = time.perf_counter_ns()
                        if mode == "qtx_preallocated":
                            s.quantize(x, columnwise=True, out=outs)
                        else:
                            q = s.quantize(x, columnwise=True)  # noqa: F841 (dropped next layer)
                        c1 = time.perf_counter_ns()
                        if record:
                            calls[mode[4:]].append((c1 - c0) / 1000.0)
                    torch.matmul(ga, gb, out=gc)
                t1.record()
            s.synchronize()
            stream.synchronize()
            return t0.elapsed_time(t1)

        for mode in ("matmul_only", "qtx_preallocated", "qtx_pooled"):
            chain(mode, False)  # warm-up: channel, registrations, cuBLAS
            ms = [chain(mode, True) for _ in range(a.reps)]
            gpu_ms = statistics.median(ms)
            line = dict(bench="py_channel_chain", mode=mode, layers=layers, gpu_ms=round(gpu_ms, 3),
                        per_layer_us=round(gpu_ms * 1000 / layers, 2),
                        gpu_ms_all=[round(v, 3) for v in ms], **base)
            if in_process_ms:
                line["in_process_gpu_ms"] = in_process_ms
                line["ratio_vs_in_process"] = round(gpu_ms / in_process_ms, 4)
            print(json.dumps(line), flush=True)
        for kind, v in calls.items():
            print(json.dumps(dict(bench="py_quantize_call", out=kind, calls=len(v),
                                  host_us_p50=round(pct(v, 0.5), 2),
                                  host_us_p99=round(pct(v, 0.99), 2), goal_us_p50=30, **base)),
                  flush=True)
        st = s.stats()
        print(json.dumps(dict(bench="py_session_stats", registrations=st["registrations"],
                              channels=st["channels"], **st["pool"], **base)), flush=True)


if __name__ == "__main__":
    main()
