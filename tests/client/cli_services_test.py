#!/usr/bin/python3
"""The `qtx` CLI's allgather, step and groups commands against qtxd processes
it starts (CPU, Gloo): two ranks with unaligned shards, a rank disagreement,
a reused group, a data-parallel sharded step over two sidecars, optimizer steps across a qtxd
restart with checkpoints.

  /usr/bin/python3 tests/client/cli_services_test.py --qtxd=build/server/qtxd \
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


def qtx(a, target, *args):
    return subprocess.Popen([a.qtx, "--target=" + target] + list(args), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(p, expect_rc, what):
    out, err = p.communicate(timeout=90)
    if p.returncode != expect_rc:
        raise AssertionError("%s: exit %d (want %d)\nstdout:\n%s\nstderr:\n%s" % (
            what, p.returncode, expect_rc, out, err))
    return out, err


def run(a, target, *args, expect_rc=0):
    return finish(qtx(a, target, *args), expect_rc, "qtx " + " ".join(args))


def both(a, targets, common, per_rank, expect_rc=0):
    """Runs one qtx command per rank at once (collective calls)."""
    procs = [qtx(a, t, *(common + per_rank[r])) for r, t in enumerate(targets)]
    return [finish(p, expect_rc, "rank %d: qtx %s" % (r, " ".join(common + per_rank[r])))
            for r, p in enumerate(procs)]


class Qtxd:
    def __init__(self, a, sock, *flags):
        self.a, self.sock, self.flags = a, sock, flags
        self.target = "unix://" + sock
        self.start()

    def start(self):
        self.p = subprocess.Popen([self.a.qtxd, "--socket=" + self.sock, "--device=cpu",
                                   "--log_level=warn", "--threads=2"] + list(self.flags))
        deadline = time.time() + 30
        while subprocess.run([self.a.qtx, "--target=" + self.target, "health"],
                             capture_output=True).returncode != 0:
            assert self.p.poll() is None, "qtxd exited: %s" % self.p.returncode
            assert time.time() < deadline, "qtxd not healthy"
            time.sleep(0.1)

    def stop(self):
        self.p.send_signal(signal.SIGTERM)
        code = self.p.wait(timeout=60)
        assert code == 0, "qtxd exit %d" % code


def check_allgather(a, servers):
    targets = [s.target for s in servers]
    coordinator = ["--coordinator=" + servers[0].target]
    # 100 + 156 rows: block row 0 (rows 0-127) straddles the two ranks.
    for mode in ("1d", "2d"):
        for gather_mode in ("exact", "high_precision"):
            outs = both(a, targets,
                        ["allgather", "--group=tp", "--world_size=2", "--mode=" + mode,
                         "--usages=rowwise,columnwise", "--dtype=bfloat16", "--seed=11",
                         "--gather_mode=" + gather_mode],
                        [["--rank=0", "--shape=100x300"],
                         ["--rank=1", "--shape=156x300"] + coordinator])
            for r, (out, _) in enumerate(outs):
                print(out)
                assert "shard_rows [100, 156]" in out, out
                assert "gathered   [256, 300]" in out, out
                assert "identical to Quantize(concat of the shards)" in out, out
                assert "created" in out, out
                if mode == "1d":
                    assert "rowwise    scale_inv   float32 [3, 256]" in out, out
                    assert "columnwise scale_inv   float32 [2, 300]" in out, out
                else:
                    assert "rowwise    scale_inv   float32 [2, 4]" in out, out
                    assert "columnwise scale_inv   float32 [3, 4]" in out, out
    # --shard_rows on both ranks: the one-round path, the same bytes.
    outs = both(a, targets,
                ["allgather", "--group=one", "--world_size=2", "--mode=2d",
                 "--usages=rowwise,columnwise", "--seed=11", "--shard_rows=100,156"],
                [["--rank=0", "--shape=100x300"], ["--rank=1", "--shape=156x300"] + coordinator])
    for out, _ in outs:
        assert "shard_rows [100, 156]" in out, out
        assert "identical to Quantize(concat of the shards)" in out, out
    # The groups were destroyed again.
    for t in targets:
        out, _ = run(a, t, "groups")
        assert "0 collective group(s)" in out, out

    # An empty shard on rank 0 and --keep_group: the group stays, a second
    # call with --sequence=1 reuses it, then `groups --destroy` removes it.
    outs = both(a, targets, ["allgather", "--group=kept", "--world_size=2", "--keep_group"],
                [["--rank=0", "--shape=0x64"], ["--rank=1", "--shape=5x64"] + coordinator])
    for out, _ in outs:
        assert "shard_rows [0, 5]" in out and "identical" in out, out
    for r, t in enumerate(targets):
        out, _ = run(a, t, "groups")
        print(out)
        assert re.search(r"^kept\s+%d\s+2\s+gloo\s+ready\s+1\s" % r, out, re.M), out
    outs = both(a, targets, ["allgather", "--group=kept", "--world_size=2", "--sequence=1"],
                [["--rank=0", "--shape=3x64"], ["--rank=1", "--shape=130x64"]])
    for out, _ in outs:
        assert "reused" in out and "shard_rows [3, 130]" in out and "identical" in out, out
    for t in targets:
        out, _ = run(a, t, "groups", "--destroy=kept")
        assert "destroyed collective group 'kept'" in out and "0 collective group(s)" in out, out
    _, err = run(a, targets[0], "groups", "--destroy=kept", expect_rc=1)
    assert "NOT_FOUND" in err, err

    # The ranks disagree on N: both fail, naming the field; no group is left.
    outs = both(a, targets, ["allgather", "--group=bad", "--world_size=2"],
                [["--rank=0", "--shape=4x128"], ["--rank=1", "--shape=4x256"] + coordinator],
                expect_rc=1)
    for _, err in outs:
        assert "INVALID_ARGUMENT" in err and "disagree" in err, err
    for t in targets:
        out, _ = run(a, t, "groups")
        assert "0 collective group(s)" in out, out

    # Usage errors.
    _, err = run(a, targets[0], "allgather", "--shape=4x4", expect_rc=1)
    assert "--group is required" in err, err
    _, err = run(a, targets[0], "allgather", "--group=x", "--shape=4x4", "--gather_mode=fast",
                 expect_rc=1)
    assert "--gather_mode=fast" in err, err


def check_sharded_step(a, servers):
    """Two sidecars own slices of one 200x130 parameter (the cut at 12345 is
    mid-row and mid-tile) and step collectively over the Collective group dp,
    then gather the FP8 parameter from both shards (--gather)."""
    targets = [s.target for s in servers]
    coordinator = ["--coordinator=" + targets[0]]
    common = ["step", "--group=z", "--shape=200x130", "--dp_group=dp", "--world_size=2",
              "--steps=2", "--gather"]
    outs = both(a, targets, common,
                [["--rank=0", "--shard=0:12345"], ["--rank=1", "--shard=12345:26000"] + coordinator])
    for r, (out, _) in enumerate(outs):
        print(out)
        assert "group      'dp' created: rank %d of 2" % r in out, out
        assert "offloaded: parameter w [200, 130]" in out, out
        assert re.search(r"^step    2: grad_norm=\S+ ", out, re.M), out
        lo, hi = (0, 12345) if r == 0 else (12345, 26000)
        assert "shard   w [%d, %d) of [200, 130]: %d FP8 bytes" % (lo, hi, hi - lo) in out, out
        assert re.search(r"^rowwise    data\s+float8_e4m3 \[%d\]$" % (hi - lo), out, re.M), out
        assert re.search(r"^rowwise    scale_inv\s+float32 \[2, 4\]$", out, re.M), out
        # --gather: the whole parameter from both owners' shards (sequence 2).
        assert "gathered w [200, 130] from ranges [0,12345) [12345,26000)" in out, out
        assert re.search(r"^rowwise    data\s+float8_e4m3 \[200, 130\]$", out, re.M), out
    # Overlapping ranges (a new optimizer group, the Collective group reused
    # at its next sequence): both ranks fail before anything changes.
    common = ["step", "--group=z2", "--shape=200x130", "--dp_group=dp", "--world_size=2",
              "--sequence=3"]
    outs = both(a, targets, common,
                [["--rank=0", "--shard=0:13000"], ["--rank=1", "--shard=12345:26000"]],
                expect_rc=1)
    for _, err in outs:
        assert "INVALID_ARGUMENT" in err and "overlap" in err, err
    _, err = run(a, targets[0], "step", "--group=z3", "--shard=0:10", expect_rc=1)
    assert "--shard needs --dp_group" in err, err
    for t in targets:
        run(a, t, "groups", "--destroy=dp", "--release=z")


def check_step(a, tmp):
    ckpt = os.path.join(tmp, "ckpt")
    os.mkdir(ckpt)
    server = Qtxd(a, os.path.join(tmp, "opt.sock"), "--checkpoint_dir=" + ckpt)
    try:
        out, _ = run(a, server.target, "step", "--group=g", "--shape=64x200", "--steps=2")
        print(out)
        assert "offloaded: parameter w [64, 200]" in out, out
        assert re.search(r"^step    1: grad_norm=\S+ lr=0.001 ", out, re.M), out
        assert re.search(r"^step    2: ", out, re.M), out
        assert "1 FP8 parameter(s) identical to Quantize(master)" in out, out
        assert re.search(r"^rowwise    data\s+float8_e4m3 \[64, 200\]$", out, re.M), out
        assert re.search(r"^columnwise data\s+float8_e4m3 \[200, 64\]$", out, re.M), out
        # The group continues where it is, with a per-call learning rate.
        out, _ = run(a, server.target, "step", "--group=g", "--lr=0.01", "--checkpoint")
        print(out)
        assert "found at step 2" in out and re.search(r"^step    3: \S+ lr=0.01 ", out, re.M), out
        assert re.search(r"checkpoint g at step 3: \S*g\.qtxopt", out), out
        out, _ = run(a, server.target, "groups")
        print(out)
        assert re.search(r"^g\s+3\s+3\s+1\s+12800\s+\d+\s+3\s", out, re.M), out
        # A restarted qtxd brings the group back from its checkpoint.
        server.stop()
        server.start()
        out, _ = run(a, server.target, "groups")
        assert re.search(r"^g\s+3\s+3\s+1\s", out, re.M), out
        out, _ = run(a, server.target, "step", "--group=g")
        assert "found at step 3" in out and re.search(r"^step    4: ", out, re.M), out
        # Two phases: GradNorm, then Step with the clip factor of --max_grad_norm.
        out, _ = run(a, server.target, "step", "--group=g", "--two_phase", "--max_grad_norm=0.001")
        print(out)
        norm = re.search(r"^norm    5: sum_squares=(\S+) grad_norm=(\S+) non_finite=0$", out, re.M)
        assert norm, out
        sum_squares, grad_norm = float(norm.group(1)), float(norm.group(2))
        assert abs(grad_norm / sum_squares ** 0.5 - 1) < 1e-5, out
        step = re.search(r"^step    5: grad_norm=0 lr=0.001 clip_coef=(\S+) skipped=0", out, re.M)
        assert step, out
        want = min(1.0, 0.001 / (sum_squares ** 0.5 + 1e-6))
        assert want < 1 and abs(float(step.group(1)) / want - 1) < 1e-5, (want, out)
        assert "1 FP8 parameter(s) identical to Quantize(master)" in out, out
        _, err = run(a, server.target, "step", "--group=g", "--two_phase", "--max_grad_norm=-1",
                     expect_rc=1)
        assert "clip_factor=-" in err and "must be finite and > 0" in err, err
        out, _ = run(a, server.target, "groups", "--release=g")
        assert "released optimizer group 'g'" in out and "0 optimizer group(s)" in out, out
        assert not os.path.exists(os.path.join(ckpt, "g.qtxopt")), os.listdir(ckpt)
        _, err = run(a, server.target, "step", "--group=g", "--shape=0x", expect_rc=1)
        assert "--shape=0x" in err, err
        _, err = run(a, server.target, "step", "--group=g", "--steps=0", expect_rc=1)
        assert "--steps" in err, err
    finally:
        if server.p.poll() is None:
            server.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--qtxd", required=True)
    ap.add_argument("--qtx", required=True)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="qtx-cli-svc-")
    servers = []
    try:
        servers = [Qtxd(a, os.path.join(tmp, "rank%d.sock" % r)) for r in range(2)]
        check_allgather(a, servers)
        check_sharded_step(a, servers)
        check_step(a, tmp)
    finally:
        for s in servers:
            if s.p.poll() is None:
                s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print("cli services test passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
