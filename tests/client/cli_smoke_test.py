#!/usr/bin/python3
"""Smoke test of the `qtx` CLI against a qtxd it starts.

  /usr/bin/python3 tests/client/cli_smoke_test.py --qtxd=build/server/qtxd \
      --qtx=build/client/cli/qtx
"""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np


def run(qtx, target, *args, expect_rc=0):
    p = subprocess.run([qtx, "--target=" + target] + list(args), capture_output=True,
                       text=True, timeout=60)
    if p.returncode != expect_rc:
        raise AssertionError("qtx %s: exit %d (want %d)\nstdout:\n%s\nstderr:\n%s" % (
            " ".join(args), p.returncode, expect_rc, p.stdout, p.stderr))
    return p.stdout, p.stderr


def check_quantize_output(out, shape, rows_cols):
    assert "input" in out and "dequant err" in out, out
    assert "[%s]" % ", ".join(str(d) for d in shape) in out, out
    m = re.search(r"max_abs=(\S+) rel_l2=(\S+)", out)
    assert m, out
    rel = float(m.group(2))
    # E4M3 with pow2 scales: relative L2 error of a normal tensor is a few %.
    assert 0 < rel < 0.06, "rel_l2=%g" % rel
    for rc in rows_cols:
        assert "[%d, %d]" % rc in out, (rc, out)
    assert re.search(r"scale_inv\s+\[", out), out


def check_token(a):
    """A token-protected qtxd: the CLI is refused without --token_file, served with it."""
    tmp = tempfile.mkdtemp(prefix="qtx-cli-tok-")
    sock = os.path.join(tmp, "qtxd.sock")
    token_file = os.path.join(tmp, "token")
    with open(token_file, "w") as f:
        f.write("cli-token-77\n")
    target = "unix://" + sock
    server = subprocess.Popen([a.qtxd, "--socket=" + sock, "--device=cpu",
                               "--auth_token_file=" + token_file, "--log_level=warn"])
    try:
        deadline = time.time() + 30
        while subprocess.run([a.qtx, "--target=" + target, "--token_file=" + token_file, "health"],
                             capture_output=True).returncode != 0:
            assert time.time() < deadline, "token-protected qtxd not healthy"
            time.sleep(0.1)
        _, err = run(a.qtx, target, "regions", expect_rc=1)
        assert "UNAUTHENTICATED" in err, err
        out, _ = run(a.qtx, target, "--token_file=" + token_file, "quantize", "--shape=8x8")
        check_quantize_output(out, [8, 8], [(8, 8)])
        with open(token_file + ".bad", "w") as f:
            f.write("wrong\n")
        _, err = run(a.qtx, target, "--token_file=" + token_file + ".bad", "regions", expect_rc=1)
        assert "UNAUTHENTICATED" in err, err
        _, err = run(a.qtx, target, "--token_file=" + tmp + "/missing", "regions", expect_rc=1)
        assert "--token_file=" in err, err
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    assert code == 0, "token qtxd exit %d" % code


def check_health_wait(a):
    """`qtx health --wait`: started before its qtxd, it returns once qtxd serves."""
    tmp = tempfile.mkdtemp(prefix="qtx-cli-wait-")
    sock = os.path.join(tmp, "qtxd.sock")
    waiter = subprocess.Popen([a.qtx, "--target=unix://" + sock, "health", "--wait=60s"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server = None
    try:
        time.sleep(0.3)
        assert waiter.poll() is None, "health --wait returned with no qtxd: %s" % (
            waiter.communicate(),)
        server = subprocess.Popen([a.qtxd, "--socket=" + sock, "--device=cpu",
                                   "--log_level=warn"])
        out, err = waiter.communicate(timeout=90)
        assert waiter.returncode == 0, (waiter.returncode, out, err)
        assert "SERVING" in out, out
    finally:
        if waiter.poll() is None:
            waiter.kill()
        code = 0
        if server is not None:
            server.send_signal(signal.SIGTERM)
            code = server.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    assert code == 0, "qtxd exit %d" % code


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qtxd", required=True)
    ap.add_argument("--qtx", required=True)
    a = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="qtx-cli-")
    sock = os.path.join(tmp, "qtxd.sock")
    target = "unix://" + sock
    server = subprocess.Popen([a.qtxd, "--socket=" + sock, "--device=cpu", "--allow_client_shm",
                               "--log_level=warn"])
    try:
        # Not up yet (or no server): health fails with exit 1.
        deadline = time.time() + 30
        while True:
            p = subprocess.run([a.qtx, "--target=" + target, "health"], capture_output=True,
                               text=True)
            if p.returncode == 0:
                break
            assert p.returncode == 1, p
            assert time.time() < deadline, "qtxd not healthy: " + p.stderr
            time.sleep(0.1)
        out, _ = run(a.qtx, target, "health")
        assert "SERVING" in out, out

        # Generated tensor, inline, 1-D both copies.
        out, _ = run(a.qtx, target, "quantize", "--shape=200x300", "--seed=7",
                     "--usages=rowwise,columnwise")
        print(out)
        check_quantize_output(out, [200, 300], [(200, 300), (300, 200), (3, 200), (2, 300)])

        # .npy input (written by numpy), 2-D, through a shm region.
        x = np.random.default_rng(0).standard_normal((130, 260)).astype("<f4")
        npy = os.path.join(tmp, "x.npy")
        np.save(npy, x)
        out, _ = run(a.qtx, target, "quantize", "--npy=" + npy, "--mode=2d", "--shm")
        print(out)
        check_quantize_output(out, [130, 260], [(130, 260), (2, 4)])
        assert "shm region" in out, out
        x16 = x.astype("<f2")
        np.save(npy, x16)
        out, _ = run(a.qtx, target, "quantize", "--npy=" + npy, "--format=e5m2")
        assert "float16" in out, out

        # The CLI's region was unregistered again.
        out, _ = run(a.qtx, target, "regions")
        print(out)
        assert "0 region(s)" in out, out

        # Errors: bad flag values, unsupported .npy dtype, no server.
        _, err = run(a.qtx, target, "quantize", "--shape=4x4", "--mode=3d", expect_rc=1)
        assert "--mode=3d" in err, err
        np.save(npy, x.astype("<f8"))
        _, err = run(a.qtx, target, "quantize", "--npy=" + npy, expect_rc=1)
        assert "'<f8'" in err, err
        _, err = run(a.qtx, target, "quantize", "--shape=4x4", "--usages=", expect_rc=1)
        assert "INVALID_ARGUMENT" in err, err
        _, err = run(a.qtx, "unix://" + tmp + "/nobody.sock", "health", expect_rc=1)
        assert "UNAVAILABLE" in err, err
        _, err = run(a.qtx, "unix://" + tmp + "/nobody.sock", "health", "--wait=300ms",
                     expect_rc=1)
        assert "DEADLINE_EXCEEDED" in err and "not SERVING after 300ms" in err, err
        _, err = run(a.qtx, target, "health", "--wait=-1s", expect_rc=1)
        assert "--wait=-1s" in err, err
        run(a.qtx, target, "frobnicate", expect_rc=2)
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    assert code == 0, "qtxd exit %d" % code
    check_token(a)
    check_health_wait(a)
    print("cli smoke test passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
