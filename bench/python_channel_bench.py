#!/usr/bin/env python3
"""python_channel_bench: what qtx.cuda costs a PyTorch training process on one
GPU (issue "qtx from Python on the GPU"). Starts qtxd --device=cuda:0
--allow_client_shm and prints JSON lines:

  {"bench":"py_quantize_call", "out":"preallocated"|"pooled"|"in_process", ...}
      host time of one asynchronous Session.quantize from Python (p50/p99/mean
      over the chain's calls; with native_lookup/submit_us_mean from
      qtx._native's counters); goal <= 30 us p50. in_process: the
      qtx_bench_inproc launch, for comparison.
  {"bench":"py_channel_chain", "mode": ...}
      GPU time of `layers` x (a [m, k] BF16 1-D row+col quantize, then a
      [m x k] x [k x k] BF16 torch.matmul on the same stream that reads
      nothing from it), issued without host waits, for
        mode "matmul_only"      the matmuls alone (a lower bound),
        mode "py_in_process"    the quantize kernel launched in this process
                                from Python (qtx_bench_inproc, built from
                                bench/python/inproc_quantize.cc) on the
                                same stream: the fair baseline,
        mode "qtx_preallocated" quantize into out= tensors,
        mode "qtx_pooled"       quantize into outputs qtx.cuda allocates
                                (dropped each layer);
      ratio_vs_py_in_process: gpu_ms / the py_in_process chain's, measured in
      this run (goal <= 1.15x with MPS). With --in_process_jsonl naming
      channel_bench's output of the same run, also ratio_vs_in_process
      against its C++ "in_process" chain (context: C++ drives cuBLAS directly).
  {"bench":"py_quantize_breakdown", ...}   (--breakdown) where a call's host
      time goes: the native part (lookup: GIL release, lock, channel and
      region lookups; submit: the channel's submission) from qtx._native's
      opt-in counters, the Python rest, and the parts measured alone.
  {"bench":"py_quantize_profile", ...}     (--breakdown) cProfile of the
      calls: the top functions by own time per call (cProfile's overhead
      inflates Python functions; use it for shares, not totals).

--legacy measures the code before the fast path with the same binary: the
region cache's fast path off (set_region_fast_path(False)), and with a
python_dir holding that version's qtx package (see scripts/gpu_python.sh).
--label names the variant in every line. MPS is the caller's business (--mps
only labels the lines).
  python3 bench/python_channel_bench.py --qtxd=PATH --python_dir=DIR [--layers=200]
      [--m=8192] [--k=4096] [--flags=host|device] [--mps=0|1] [--in_process_jsonl=FILE]
      [--inproc_dir=DIR] [--breakdown] [--legacy] [--label=NAME]
"""

import argparse
import inspect
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
    p.add_argument("--inproc_dir", default="",
                   help="directory holding the qtx_bench_inproc module")
    p.add_argument("--breakdown", action="store_true")
    p.add_argument("--legacy", action="store_true")
    p.add_argument("--label", default="")
    a = p.parse_args()
    sys.path.insert(0, a.python_dir)
    import torch
    import qtx.cuda as qcuda

    inproc = None
    if a.inproc_dir:
        sys.path.insert(0, a.inproc_dir)
        try:
            import qtx_bench_inproc as inproc
        except ImportError as e:
            print("qtx_bench_inproc not importable (%s): no py_in_process chain" % e,
                  file=sys.stderr)

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
        run(a, torch, qcuda, target, inproc)
    finally:
        server.terminate()
        server.wait(10)


def timed(n, fn):
    """p50 of fn()'s host time over n calls, in us."""
    v = []
    for _ in range(n):
        c0 = time.perf_counter_ns()
        fn()
        v.append((time.perf_counter_ns() - c0) / 1000.0)
    return round(pct(v, 0.5), 3)


def run(a, torch, qcuda, target, inproc):
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
    base = {"flags": a.flags, "mps": a.mps, "m": m, "k": k, "torch": torch.__version__,
            "variant": a.label or ("legacy" if a.legacy else "current")}

    in_process_ms = None
    if a.in_process_jsonl and os.path.exists(a.in_process_jsonl):
        for line in open(a.in_process_jsonl):
            if line.startswith("{"):
                d = json.loads(line)
                if d.get("bench") == "channel_chain" and d.get("mode") == "in_process":
                    in_process_ms = d["gpu_ms"]

    kw = {}
    if "allocator" in inspect.signature(qcuda.Session.__init__).parameters:
        kw["allocator"] = "framework"
    with qcuda.Session(target, flag_memory=a.flags, label="bench", **kw) as s:
        native = s._native
        if a.legacy and hasattr(native, "set_region_fast_path"):
            native.set_region_fast_path(False)
        calls = {"preallocated": [], "pooled": [], "in_process": []}
        raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        ptrs = [outs[f].data_ptr() for f in qcuda.FIELDS]

        def inproc_quantize():
            inproc.quantize(x.data_ptr(), 2, m, k, 1, 1, True, True, True, 0.0, ptrs[0],
                            ptrs[1], ptrs[2], ptrs[3],
                            raw_stream(0) if raw_stream else
                            torch.cuda.current_stream().cuda_stream)

        nat = {"preallocated": [0, 0, 0], "pooled": [0, 0, 0]}  # calls, lookup ns, submit ns

        def chain(mode, record):
            # qtx._native's opt-in counters over the recorded chains (three clock reads a call).
            prof = record and mode.startswith("qtx_") and hasattr(native, "set_profiling")
            if prof:
                native.set_profiling(True)
                native.profile()  # clear
            stream.synchronize()
            with torch.cuda.stream(stream):
                t0.record()
                for _ in range(layers):
                    if mode != "matmul_only":
                        c0 = time.perf_counter_ns()
                        if mode == "qtx_preallocated":
                            s.quantize(x, columnwise=True, out=outs)
                        elif mode == "py_in_process":
                            inproc_quantize()
                        else:
                            q = s.quantize(x, columnwise=True)  # noqa: F841 (dropped next layer)
                        c1 = time.perf_counter_ns()
                        if record:
                            calls[mode.split("_", 1)[1]].append((c1 - c0) / 1000.0)
                    torch.matmul(ga, gb, out=gc)
                t1.record()
            if prof:
                pr = native.profile()
                native.set_profiling(False)
                acc = nat[mode[4:]]
                acc[0] += pr["calls"]
                acc[1] += pr["lookup_ns"]
                acc[2] += pr["submit_ns"]
            s.synchronize()
            stream.synchronize()
            return t0.elapsed_time(t1)

        modes = ["matmul_only"] + (["py_in_process"] if inproc else []) + [
            "qtx_preallocated", "qtx_pooled"]
        results = {}
        for mode in modes:
            chain(mode, False)  # warm-up: channel, registrations, cuBLAS
            ms = [chain(mode, True) for _ in range(a.reps)]
            results[mode] = (statistics.median(ms), ms)
        py_in = results.get("py_in_process", (None,))[0]
        for mode in modes:
            gpu_ms, ms = results[mode]
            line = dict(bench="py_channel_chain", mode=mode, layers=layers,
                        gpu_ms=round(gpu_ms, 3), per_layer_us=round(gpu_ms * 1000 / layers, 2),
                        gpu_ms_all=[round(v, 3) for v in ms], **base)
            if py_in:
                line["py_in_process_gpu_ms"] = round(py_in, 3)
                line["ratio_vs_py_in_process"] = round(gpu_ms / py_in, 4)
            if in_process_ms:
                line["in_process_gpu_ms"] = in_process_ms
                line["ratio_vs_in_process"] = round(gpu_ms / in_process_ms, 4)
            print(json.dumps(line), flush=True)
        for kind, v in calls.items():
            if v:
                line = dict(bench="py_quantize_call", out=kind, calls=len(v),
                            host_us_p50=round(pct(v, 0.5), 2), host_us_p99=round(pct(v, 0.99), 2),
                            host_us_mean=round(sum(v) / len(v), 2), goal_us_p50=30, **base)
                n = nat.get(kind, [0])[0]
                if n:
                    line.update(native_lookup_us_mean=round(nat[kind][1] / n / 1000, 2),
                                native_submit_us_mean=round(nat[kind][2] / n / 1000, 2))
                print(json.dumps(line), flush=True)
        if a.breakdown:
            breakdown(a, torch, qcuda, s, x, outs, stream, base)
        st = s.stats()
        print(json.dumps(dict(bench="py_session_stats", registrations=st["registrations"],
                              channels=st["channels"], **st["pool"], **base)), flush=True)


def breakdown(a, torch, qcuda, s, x, outs, stream, base):
    """Where a quantize call's host time goes (see the module doc)."""
    import cProfile
    import pstats
    native = s._native
    n = 300
    with torch.cuda.stream(stream):
        for kind in ("preallocated", "pooled"):
            def call(kind=kind):
                if kind == "preallocated":
                    s.quantize(x, columnwise=True, out=outs)
                else:
                    s.quantize(x, columnwise=True)
            # Native counters vs the whole call (no profiler running).
            have_prof = hasattr(native, "set_profiling")
            if have_prof:
                native.set_profiling(True)
                native.profile()  # clear
            tot = []
            for i in range(n):
                c0 = time.perf_counter_ns()
                call()
                tot.append(time.perf_counter_ns() - c0)
                if i % 50 == 49:
                    s.synchronize()  # bound the queue
            line = dict(bench="py_quantize_breakdown", out=kind, calls=n,
                        host_us_p50=round(pct(tot, 0.5) / 1000, 2),
                        host_us_mean=round(sum(tot) / n / 1000, 2), **base)
            if have_prof:
                pr = native.profile()
                native.set_profiling(False)
                c = max(1, pr["calls"])
                line.update(native_calls=pr["calls"],
                            native_lookup_us_mean=round(pr["lookup_ns"] / c / 1000, 2),
                            native_submit_us_mean=round(pr["submit_ns"] / c / 1000, 2),
                            python_rest_us_mean=round(
                                (sum(tot) / n - (pr["lookup_ns"] + pr["submit_ns"]) / c) / 1000,
                                2),
                            region_fast_hits=pr["fast_hits"])
            print(json.dumps(line), flush=True)
            s.synchronize()
            # cProfile: own time per call of the top functions.
            prof = cProfile.Profile()
            prof.enable()
            for i in range(n):
                call()
                if i % 50 == 49:
                    s.synchronize()
            prof.disable()
            s.synchronize()
            st = pstats.Stats(prof)
            rows = []
            for (fn, ln, name), (cc, nc, tt, ct, _) in st.stats.items():
                rows.append((tt, ct, nc, "%s:%d(%s)" % (os.path.basename(fn), ln, name)))
            rows.sort(reverse=True)
            print(json.dumps(dict(bench="py_quantize_profile", out=kind, calls=n,
                                  top=[dict(fn=r[3], own_us_per_call=round(r[0] / n * 1e6, 2),
                                            cum_us_per_call=round(r[1] / n * 1e6, 2),
                                            ncalls_per_call=round(r[2] / n, 2))
                                       for r in rows[:14]], **base)), flush=True)
        # Parts alone (p50 of 2000 each).
        parts = {}
        parts["torch_current_stream_public_us"] = timed(
            2000, lambda: torch.cuda.current_stream(0).cuda_stream)
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            parts["torch_current_raw_stream_us"] = timed(2000, lambda: raw(0))
        parts["as_cuda_array_us"] = timed(2000, lambda: qcuda.as_cuda_array(x, "x"))
        parts["x_data_ptr_us"] = timed(2000, x.data_ptr)
        ptr, nbytes = x.data_ptr(), x.numel() * 2
        parts["native_slice_us"] = timed(2000, lambda: native.slice(0, ptr, nbytes))
        if hasattr(native, "set_region_fast_path"):
            native.set_region_fast_path(False)
            parts["native_slice_full_path_us"] = timed(2000, lambda: native.slice(0, ptr, nbytes))
            native.set_region_fast_path(not a.legacy)
        lay = qcuda.layout(tuple(x.shape))
        dev = torch.device("cuda", 0)
        parts["torch_empty_x4_us"] = timed(2000, lambda: [
            torch.empty(lay[f], dtype=torch.float32 if "scale" in f else torch.uint8,
                        device=dev) for f in qcuda.FIELDS])
        blk = s.pool.alloc(0, stream.cuda_stream, 1 << 20)

        def wrap():
            qcuda._wrap_many(blk, [((256, 1024), qcuda.UINT8), ((256, 8), qcuda.FLOAT32),
                                   ((1024, 256), qcuda.UINT8), ((8, 256), qcuda.FLOAT32)],
                             [0, 262144, 270336, 532480], "torch")
        parts["pool_wrap_as_tensor_x4_views_us"] = timed(500, wrap)
        del blk
        print(json.dumps(dict(bench="py_quantize_parts", **parts, **base)), flush=True)


if __name__ == "__main__":
    main()
