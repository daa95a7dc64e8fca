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
                                (dropped each layer),
        mode "qtx_*_bgw0|1"     the same with Session(background_writer=
                                False|True), the setting that is not the
                                package's default (packages that have it);
      ratio_vs_py_in_process: gpu_ms / the py_in_process chain's, measured in
      this run (goal <= 1.15x with MPS). With --in_process_jsonl naming
      channel_bench's output of the same run, also ratio_vs_in_process
      against its C++ "in_process" chain (context: C++ drives cuBLAS directly).
  {"bench":"py_quantize_breakdown", ...}   (--breakdown) where a call's host
      time goes: the native part (lookup: lock, channel and region lookups;
      submit: the channel's submission, split by qtx::ChannelSubmitProfile
      into check / build (protobuf) / signal (ready write) / enqueue (stream
      write) / wait (done wait) where the module has it) from qtx._native's
      opt-in counters, the Python rest, python_only_us_p50 (the call with
      the native submission replaced by a no-op: Python, argument checks,
      result object), and the parts measured alone.
  {"bench":"py_quantize_profile", ...}     (--breakdown) cProfile of the
      calls: the top functions by own time per call (cProfile's overhead
      inflates Python functions; use it for shares, not totals).

A/B: run once with the working tree's package and module and once with
another (e.g. main's package with main's module, --label=main); both print
the same lines.
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
    params = inspect.signature(qcuda.Session.__init__).parameters
    if "allocator" in params:
        kw["allocator"] = "framework"
    # The package's default session, and (packages with background_writer)
    # one with the other setting, measured as modes "qtx_*_bgw0" / "_bgw1".
    s_alt, suffix = None, ""
    if "background_writer" in params:
        default_bgw = bool(params["background_writer"].default)
        base["background_writer_default"] = default_bgw
        suffix = "_bgw%d" % (not default_bgw)
        s_alt = qcuda.Session(target, flag_memory=a.flags, label="bench-alt",
                              background_writer=not default_bgw, **kw)
    with qcuda.Session(target, flag_memory=a.flags, label="bench", **kw) as s:
        native = s._native
        if a.legacy and hasattr(native, "set_region_fast_path"):
            native.set_region_fast_path(False)
        raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        ptrs = [outs[f].data_ptr() for f in qcuda.FIELDS]

        def inproc_quantize():
            inproc.quantize(x.data_ptr(), 2, m, k, 1, 1, True, True, True, 0.0, ptrs[0],
                            ptrs[1], ptrs[2], ptrs[3],
                            raw_stream(0) if raw_stream else
                            torch.cuda.current_stream().cuda_stream)

        def chain(mode, record, calls, nat):
            # qtx._native's opt-in counters over the recorded chains (a few clock reads a call).
            ss = s_alt if suffix and mode.endswith(suffix) else s
            nv = ss._native
            prof = record and mode.startswith("qtx_") and hasattr(nv, "set_profiling")
            if prof:
                nv.set_profiling(True)
                nv.profile()  # clear
            stream.synchronize()
            with torch.cuda.stream(stream):
                t0.record()
                for _ in range(layers):
                    if mode != "matmul_only":
                        c0 = time.perf_counter_ns()
                        if mode.startswith("qtx_preallocated"):
                            ss.quantize(x, columnwise=True, out=outs)
                        elif mode == "py_in_process":
                            inproc_quantize()
                        else:
                            q = ss.quantize(x, columnwise=True)  # noqa: F841 (dropped next layer)
                        c1 = time.perf_counter_ns()
                        if record:
                            calls.append((c1 - c0) / 1000.0)
                    torch.matmul(ga, gb, out=gc)
                t1.record()
            if prof:
                pr = nv.profile()
                nv.set_profiling(False)
                for key, v in pr.items():
                    nat[key] = nat.get(key, 0) + v
            ss.synchronize()
            stream.synchronize()
            return t0.elapsed_time(t1)

        modes = ["matmul_only"] + (["py_in_process"] if inproc else []) + [
            "qtx_preallocated", "qtx_pooled"] + (
            ["qtx_preallocated" + suffix, "qtx_pooled" + suffix] if s_alt else [])
        py_in = None
        for mode in modes:  # each mode's lines as soon as it is measured
            calls, nat = [], {}
            try:
                chain(mode, False, [], {})  # warm-up: channel, registrations, cuBLAS
                ms = [chain(mode, True, calls, nat) for _ in range(a.reps)]
            except Exception as e:  # noqa: BLE001 - reported, the other modes still run
                print(json.dumps(dict(bench="py_channel_chain", mode=mode, error=repr(e),
                                      **base)), flush=True)
                continue
            gpu_ms = statistics.median(ms)
            if mode == "py_in_process":
                py_in = gpu_ms
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
            if calls:
                kind = mode.split("_", 1)[1]
                line = dict(bench="py_quantize_call", out=kind, calls=len(calls),
                            host_us_p50=round(pct(calls, 0.5), 2),
                            host_us_p99=round(pct(calls, 0.99), 2),
                            host_us_mean=round(sum(calls) / len(calls), 2), goal_us_p50=30,
                            **base)
                line.update(native_fields(nat))
                print(json.dumps(line), flush=True)
        if a.breakdown:
            for ss, sfx in ((s, ""), (s_alt, suffix)):
                if ss is None:
                    continue
                try:
                    breakdown(a, torch, qcuda, ss, x, outs, stream, base, suffix=sfx,
                              with_parts=not sfx)
                except Exception as e:  # noqa: BLE001 - reported
                    print(json.dumps(dict(bench="py_quantize_breakdown", out=sfx,
                                          error=repr(e), **base)), flush=True)
        st = s.stats()
        print(json.dumps(dict(bench="py_session_stats", registrations=st["registrations"],
                              channels=st["channels"], **st["pool"], **base)), flush=True)
    if s_alt is not None:
        s_alt.close()


def native_fields(pr):
    """Per-call means (us) of qtx._native's profile() sums."""
    n = pr.get("calls", 0)
    if not n:
        return {}
    d = dict(native_lookup_us_mean=round(pr["lookup_ns"] / n / 1000, 2),
             native_submit_us_mean=round(pr["submit_ns"] / n / 1000, 2))
    c = pr.get("channel_calls", 0)
    if c:
        for part in ("check", "build", "signal", "enqueue", "wait"):
            d["channel_%s_us_mean" % part] = round(pr["channel_%s_ns" % part] / c / 1000, 2)
    return d


def python_only(s, x, outs, kind, n=2000):
    """p50 (us) of s.quantize with the native submission replaced by a
    no-op (the fast path's submit_quantize, or an older module's
    quantize_into / quantize): what Python costs before and after it."""
    class Stub:
        def __getattr__(self, name):
            return getattr(s._native, name)

        def quantize_into(self, *args):
            return 1

        def quantize(self, *args):
            return 1

    saved_native, saved_submit = s._native, getattr(s, "_submit", None)
    try:
        if saved_submit is not None:
            s._submit = lambda *args: 1
        else:
            s._native = Stub()
        if kind == "preallocated":
            return timed(n, lambda: s.quantize(x, columnwise=True, out=outs))
        return timed(n, lambda: s.quantize(x, columnwise=True))
    finally:
        s._native = saved_native
        if saved_submit is not None:
            s._submit = saved_submit


def breakdown(a, torch, qcuda, s, x, outs, stream, base, suffix="", with_parts=True):
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
            line = dict(bench="py_quantize_breakdown", out=kind + suffix, calls=n,
                        host_us_p50=round(pct(tot, 0.5) / 1000, 2),
                        host_us_mean=round(sum(tot) / n / 1000, 2), **base)
            if have_prof:
                pr = native.profile()
                native.set_profiling(False)
                c = max(1, pr["calls"])
                line.update(native_calls=pr["calls"], **native_fields(pr))
                line.update(python_rest_us_mean=round(
                                (sum(tot) / n - (pr["lookup_ns"] + pr["submit_ns"]) / c) / 1000,
                                2),
                            region_fast_hits=pr["fast_hits"])
            s.synchronize()
            line["python_only_us_p50"] = python_only(s, x, outs, kind)
            s.synchronize()
            print(json.dumps(line), flush=True)
            if not with_parts:
                continue
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
            print(json.dumps(dict(bench="py_quantize_profile", out=kind + suffix, calls=n,
                                  top=[dict(fn=r[3], own_us_per_call=round(r[0] / n * 1e6, 2),
                                            cum_us_per_call=round(r[1] / n * 1e6, 2),
                                            ncalls_per_call=round(r[2] / n, 2))
                                       for r in rows[:14]], **base)), flush=True)
        if not with_parts:
            return
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
