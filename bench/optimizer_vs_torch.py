#!/usr/bin/python3
"""Host AdamW step of qtx (kernels/cpu, FP8 BLOCK_2D row+col output) next to
torch's CPU AdamW (no FP8 output) and memcpy, in one run, at the same thread
counts. JSON lines on stdout (formulas in bench/README.md):

  {"bench":"adamw_cpu",...}      from optimizer_cpu_bench (qtx, and its memcpy lines)
  {"bench":"torch_adamw",...}    torch.optim.AdamW on one [m, n] FP32 parameter
  {"bench":"adamw_vs_torch",...} per thread count: qtx / torch params/s

torch implementations: "fused" (torch.optim.AdamW(fused=True) on CPU: torch >= 2.4),
"foreach" (multi-tensor, vectorized ops) and "forloop" (single-tensor). Debian's
torch 1.13 has no fused CPU AdamW; it is reported as unavailable there.

  /usr/bin/python3 bench/optimizer_vs_torch.py --bench=build/bench/optimizer_cpu_bench \\
      [--m=4096 --n=4096] [--max_threads=N] [--reps=5] [--grad=fp32]
"""

import argparse
import json
import os
import subprocess
import sys
import time


def torch_adamw(torch, m, n, threads, impl, reps):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(1)
    p = torch.nn.Parameter(torch.randn(m, n, generator=g) * 0.02)
    p.grad = torch.randn(m, n, generator=g) * 1e-3
    kwargs = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
    if impl == "fused":
        kwargs["fused"] = True
    elif impl == "foreach":
        kwargs["foreach"] = True
    else:
        kwargs["foreach"] = False
    opt = torch.optim.AdamW([p], **kwargs)
    with torch.no_grad():
        opt.step()  # allocates the moments
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            opt.step()
            best = min(best, time.perf_counter() - t0)
    return best


def fused_available(torch):
    try:
        p = torch.nn.Parameter(torch.zeros(4))
        p.grad = torch.zeros(4)
        torch.optim.AdamW([p], fused=True).step()
        return True, ""
    except Exception as e:  # TypeError (no such argument) or RuntimeError (CPU unsupported)
        return False, "%s: %s" % (type(e).__name__, str(e).splitlines()[0][:120])


def thread_counts(max_threads):
    out, t = [], 1
    while t <= max_threads:
        out.append(t)
        if t < max_threads and t * 2 > max_threads:
            t = max_threads
        else:
            t *= 2
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True, help="path to optimizer_cpu_bench")
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--max_threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--grad", choices=["fp32", "bf16"], default="fp32",
                    help="qtx gradient dtype (torch always steps FP32 gradients)")
    args = ap.parse_args()

    qtx_rate, memcpy = {}, {}
    out = subprocess.run([args.bench, str(args.m), str(args.n), str(args.max_threads),
                          str(args.reps), args.grad], check=True, capture_output=True,
                         text=True).stdout
    for line in out.splitlines():
        print(line)
        r = json.loads(line)
        if r["bench"] == "adamw_cpu":
            qtx_rate[r["threads"]] = r["params_per_s"]
        elif r["bench"] == "memcpy":
            memcpy[r["threads"]] = r["gbps"]
    sys.stdout.flush()

    try:
        import torch
    except ImportError:
        print(json.dumps({"bench": "torch_adamw", "error": "torch is not importable"}))
        return 0
    has_fused, why = fused_available(torch)
    impls = (["fused"] if has_fused else []) + ["foreach", "forloop"]
    if not has_fused:
        print(json.dumps({"bench": "torch_adamw", "impl": "fused", "torch": torch.__version__,
                          "available": False, "reason": why}))
    count = args.m * args.n
    torch_bytes = count * (8 + 16 + 4)  # master r+w, 2 moments r+w, FP32 grad read
    for t in thread_counts(args.max_threads):
        best_impl, best_rate = None, 0.0
        for impl in impls:
            s = torch_adamw(torch, args.m, args.n, t, impl, args.reps)
            rate = count / s
            print(json.dumps({"bench": "torch_adamw", "impl": impl, "torch": torch.__version__,
                              "m": args.m, "n": args.n, "threads": t, "grad": "fp32",
                              "output": "none", "time_ms": round(s * 1e3, 3),
                              "params_per_s": float("%.4g" % rate),
                              "bytes_moved_gbps": round(torch_bytes / s / 1e9, 3)}))
            if rate > best_rate:
                best_impl, best_rate = impl, rate
        if t in qtx_rate:
            print(json.dumps({"bench": "adamw_vs_torch", "threads": t,
                              "qtx_params_per_s": qtx_rate[t],
                              "torch_impl": best_impl, "torch_params_per_s":
                              float("%.4g" % best_rate),
                              "ratio": round(qtx_rate[t] / best_rate, 3),
                              "memcpy_gbps": memcpy.get(t),
                              "torch_fused_available": has_fused}))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
