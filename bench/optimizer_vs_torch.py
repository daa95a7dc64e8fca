#!/usr/bin/python3
"""Host AdamW step of qtx (kernels/cpu, FP8 BLOCK_2D row+col output) next to
torch's CPU AdamW (no FP8 output) and the host's triad bandwidth, in one run, at
the same thread counts. JSON lines on stdout (formulas in bench/README.md):

  {"bench":"host_triad",...}      from optimizer_cpu_bench (triad bandwidth, same process)
  {"bench":"adamw_cpu",...}       from optimizer_cpu_bench (qtx; fraction_of_triad)
  {"bench":"adamw_phase",...}     from optimizer_cpu_bench --phases (first round only)
  {"bench":"torch_adamw",...}     torch.optim.AdamW on one [m, n] FP32 parameter
  {"bench":"adamw_vs_torch",...}  per binary and thread count, best over the rounds:
                                  qtx / torch params/s, qtx GB/s / triad GB/s, and
                                  qtx / the first binary's params/s (A/B); the
                                  same two ratios of the median rounds
                                  (ratio_median, vs_first_median); and, round by
                                  round against the first binary, the median
                                  ratio and the rounds won
                                  (vs_first_paired_median,
                                  rounds_faster_than_first), and the same against
                                  torch (ratio_paired_median,
                                  rounds_faster_than_torch)

torch implementations: "fused" (torch.optim.AdamW(fused=True) on CPU: torch >= 2.4),
"foreach" (multi-tensor, vectorized ops) and "forloop" (single-tensor). Debian's
torch 1.13 has no fused CPU AdamW; it is reported as unavailable there.

Several binaries (A/B of kernels): --bench=LABEL=PATH, repeated; the first one is
the baseline of "vs_first". Each round runs every binary (order reversed in odd
rounds), then torch, so that slow drifts of the host hit every side alike.
--bench_flag=LABEL=FLAG gives one bench more flags, so that one binary under two
labels compares two settings, e.g. the FP8 output written with and without the
columnwise copy: --bench=rowcol=PATH --bench=row=PATH --bench_flag=row=--output=row.

  /usr/bin/python3 bench/optimizer_vs_torch.py --bench=build/bench/optimizer_cpu_bench \\
      [--m=4096 --n=4096] [--max_threads=N] [--reps=5] [--grad=fp32] [--rounds=1] \\
      [--torch_impls=fused,foreach,forloop] [--phases] [--bench_flag=LABEL=FLAG]
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


def median(values):
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def parse_benches(items):
    out = []
    for item in items:
        label, sep, path = item.partition("=")
        if not sep:
            label, path = os.path.basename(item), item
        out.append((label, path))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True, action="append",
                    help="path to optimizer_cpu_bench, or LABEL=PATH; repeat for an A/B")
    ap.add_argument("--bench_flag", action="append", default=[],
                    help="LABEL=FLAG: one more flag for that bench, e.g. row=--output=row "
                         "(the same binary under two labels compares two settings); repeatable")
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--max_threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--grad", choices=["fp32", "bf16"], default="fp32",
                    help="qtx gradient dtype (torch always steps FP32 gradients)")
    ap.add_argument("--torch_impls", default="fused,foreach,forloop")
    ap.add_argument("--phases", action="store_true",
                    help="optimizer_cpu_bench --phases in the first round")
    args = ap.parse_args()
    benches = parse_benches(args.bench)
    extra = {}  # label -> flags
    for item in args.bench_flag:
        label, sep, flag = item.partition("=")
        if not sep or label not in dict(benches):
            ap.error("--bench_flag=%s: LABEL=FLAG with the LABEL of a --bench" % item)
        extra.setdefault(label, []).append(flag)
    threads = thread_counts(args.max_threads)

    try:
        import torch
    except ImportError:
        torch = None
        print(json.dumps({"bench": "torch_adamw", "error": "torch is not importable"}))
    impls = []
    has_fused = False
    if torch is not None:
        has_fused, why = fused_available(torch)
        wanted = args.torch_impls.split(",")
        impls = [i for i in wanted if i != "fused" or has_fused]
        if "fused" in wanted and not has_fused:
            print(json.dumps({"bench": "torch_adamw", "impl": "fused",
                              "torch": torch.__version__, "available": False, "reason": why}))

    # best over rounds: qtx[label][t] = params/s, gbps[label][t], triad[label][t]
    qtx = {label: {} for label, _ in benches}
    qtx_gbps = {label: {} for label, _ in benches}
    triad = {label: {} for label, _ in benches}
    best_torch = {}  # t -> (params/s, impl)
    qtx_rounds = {label: {} for label, _ in benches}  # t -> params/s of every round
    torch_rounds = {}  # (t, impl) -> params/s of every round
    count = args.m * args.n
    torch_bytes = count * (8 + 16 + 4)  # master r+w, 2 moments r+w, FP32 grad read
    for rnd in range(args.rounds):
        order = benches if rnd % 2 == 0 else list(reversed(benches))
        for label, path in order:
            cmd = [path, str(args.m), str(args.n), str(args.max_threads), str(args.reps),
                   args.grad, "--label=" + label]
            cmd += extra.get(label, [])
            if args.phases and rnd == 0:
                cmd.append("--phases")
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            for line in out.splitlines():
                r = json.loads(line)
                r["round"] = rnd
                print(json.dumps(r))
                t = r.get("threads")
                if r["bench"] == "adamw_cpu":
                    qtx[label][t] = max(qtx[label].get(t, 0.0), r["params_per_s"])
                    qtx_rounds[label].setdefault(t, []).append(r["params_per_s"])
                    qtx_gbps[label][t] = max(qtx_gbps[label].get(t, 0.0), r["bytes_moved_gbps"])
                elif r["bench"] == "host_triad":
                    triad[label][t] = max(triad[label].get(t, 0.0), r["gbps"])
            sys.stdout.flush()
        for t in threads:
            for impl in impls:
                s = torch_adamw(torch, args.m, args.n, t, impl, args.reps)
                rate = count / s
                print(json.dumps({"bench": "torch_adamw", "impl": impl, "torch": torch.__version__,
                                  "m": args.m, "n": args.n, "threads": t, "grad": "fp32",
                                  "output": "none", "time_ms": round(s * 1e3, 3),
                                  "params_per_s": float("%.4g" % rate),
                                  "bytes_moved_gbps": round(torch_bytes / s / 1e9, 3),
                                  "round": rnd}))
                torch_rounds.setdefault((t, impl), []).append(rate)
                if rate > best_torch.get(t, (0.0, None))[0]:
                    best_torch[t] = (rate, impl)
            sys.stdout.flush()

    first = benches[0][0]
    for label, _ in benches:
        for t in threads:
            if t not in qtx[label]:
                continue
            rec = {"bench": "adamw_vs_torch", "label": label, "threads": t,
                   "rounds": args.rounds, "qtx_params_per_s": qtx[label][t],
                   "qtx_gbps": qtx_gbps[label][t], "triad_gbps": triad[label].get(t),
                   "fraction_of_triad": round(qtx_gbps[label][t] / triad[label][t], 3)
                   if triad[label].get(t) else None,
                   "vs_first": round(qtx[label][t] / qtx[first][t], 3)
                   if t in qtx[first] else None,
                   # The same from the median round (a noisy host: the best
                   # round alone can be an outlier).
                   "qtx_median_params_per_s": float("%.4g" % median(qtx_rounds[label][t])),
                   "vs_first_median": round(median(qtx_rounds[label][t]) /
                                            median(qtx_rounds[first][t]), 3)
                   if t in qtx_rounds[first] else None}
            if t in qtx_rounds[first]:
                # Paired by round (both ran within the same minutes): the
                # median of this / first per round, and the rounds it was
                # faster in. On a host whose speed drifts between rounds this
                # separates a small difference from the drift better than
                # ratios of separate medians.
                pairs = [a / b for a, b in zip(qtx_rounds[label][t], qtx_rounds[first][t])]
                rec["vs_first_paired_median"] = round(median(pairs), 3)
                rec["rounds_faster_than_first"] = sum(1 for x in pairs if x > 1.0)
            if t in best_torch:
                rate, impl = best_torch[t]
                rec.update({"torch_impl": impl, "torch_params_per_s": float("%.4g" % rate),
                            "torch_gbps": round(torch_bytes / (count / rate) / 1e9, 3),
                            "ratio": round(qtx[label][t] / rate, 3),
                            "ratio_median": round(median(qtx_rounds[label][t]) /
                                                  median(torch_rounds[(t, impl)]), 3),
                            # qtx / torch round by round (each round runs torch
                            # right after the binaries): median, and rounds won.
                            "ratio_paired_median": round(median(
                                [a / b for a, b in zip(qtx_rounds[label][t],
                                                       torch_rounds[(t, impl)])]), 3),
                            "rounds_faster_than_torch": sum(
                                1 for a, b in zip(qtx_rounds[label][t], torch_rounds[(t, impl)])
                                if a > b),
                            "torch_fused_available": has_fused})
            print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
