#!/usr/bin/python3
# Manual check for issue 18 item 1 (the CI test is robustness_fault_test
# Faults.ShmShrunkDuringCallsFailsThoseCallsOnly): usage
#   /usr/bin/python3 scripts/shm_shrink_probe.py build/server/qtxd
# A qtxd without the SIGBUS guard dies (returncode -7) on the first try.
# Pre/post-fix probe for issue 18 item 1: shrink a registered shm object while
# qtxd quantizes from it; report whether qtxd survived.
import os, subprocess, sys, tempfile, threading, time
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "client", "python"))
import numpy as np, qtx
qtxd = sys.argv[1]
d = tempfile.mkdtemp(); sock = d + "/q.sock"
p = subprocess.Popen([qtxd, "--device=cpu", "--socket=" + sock, "--allow_client_shm",
                      "--threads=2", "--log_level=error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
c = qtx.Client("unix://" + sock)
for _ in range(200):
    try:
        if c.health(timeout=1) == "SERVING": break
    except Exception:
        pass
    time.sleep(0.05)
shape = (4096, 4096); nbytes = 4096 * 4096 * 4
outcomes = []
for t in range(10):
    r = qtx.ShmRegion("probe%d" % t, nbytes)
    r.view(0, np.float32, shape)[:] = np.random.default_rng(t).standard_normal(shape, dtype=np.float32)
    c.register_shm_region(r)
    t0 = time.time(); c.quantize_region(r, 0, shape); dur = time.time() - t0
    res = {}
    def call():
        try: c.quantize_region(r, 0, shape); res["s"] = "OK"
        except Exception as e: res["s"] = type(e).__name__
    th = threading.Thread(target=call); th.start()
    time.sleep(dur * 0.03 * (t + 1))
    os.truncate("/dev/shm/" + r.shm_name.lstrip("/"), 0)
    th.join()
    alive = p.poll() is None
    outcomes.append((res.get("s"), alive, p.returncode))
    if not alive: break
print("qtxd=%s tries=%s" % (qtxd, outcomes))
p.kill()
