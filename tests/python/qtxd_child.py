"""Test helper: qtxd child processes of a Python test, never left behind.

    server = qtxd_child.start(qtxd, tmp_dir, ["--device=cpu"], probe=ready)
    ... server.target ...
    assert server.stop() == 0          # SIGTERM, then the exit status

start() runs `qtxd --socket=<dir>/<name>.sock --log_level=warn <extra...>` and
returns once `probe(target)` returns a true value (a gRPC call the test makes
with its own client; an exception means "not up yet"). A qtxd that outlives
its test would keep the test's stdout open, and CTest waits for that pipe
until the test's timeout: so every child is killed when the interpreter exits
(atexit), and, when started from the main thread, also when the test process
dies without running atexit (Linux's parent-death signal, set by util-linux's
`setpriv --pdeathsig KILL`, which then execs qtxd: a preexec_fn would run
Python in the forked child of a process with gRPC threads, which can
deadlock).
"""

import atexit
import os
import shutil
import signal
import subprocess
import threading
import time

_CHILDREN = []
_SETPRIV = shutil.which("setpriv")


def _kill_leftovers():
    for proc in _CHILDREN:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


atexit.register(_kill_leftovers)


class Child:
    """A running qtxd: proc (subprocess.Popen), target ("unix://..."), socket."""

    def __init__(self, proc, socket):
        self.proc = proc
        self.socket = socket
        self.target = "unix://" + socket

    def stop(self, timeout=30):
        """SIGTERM (a clean shutdown: qtxd checkpoints) and the exit status;
        killed, and the status is the kill's, when it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()

    def kill(self):
        """kill -9 (no shutdown) and reap."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def start(qtxd, sock_dir, extra=(), probe=None, name="qtxd", timeout=30, log=None):
    """Starts qtxd on <sock_dir>/<name>.sock and waits until probe(target)
    returns a true value (without a probe: until the socket file exists).
    `log`: a file path that gets qtxd's stdout and stderr (default: the
    test's own). Raises RuntimeError, with the child killed, when qtxd exits
    during startup or is not ready after `timeout` seconds."""
    socket = os.path.join(sock_dir, name + ".sock")
    argv = [qtxd, "--socket=" + socket, "--log_level=warn"] + list(extra)
    # The signal comes when the thread that forked exits: main thread only.
    if _SETPRIV and threading.current_thread() is threading.main_thread():
        argv = [_SETPRIV, "--pdeathsig", "KILL", "--"] + argv
    if log is None:
        proc = subprocess.Popen(argv)
    else:
        with open(log, "w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    _CHILDREN.append(proc)
    child = Child(proc, socket)
    deadline = time.time() + timeout
    last = "no socket file"
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("%s exited with %d during startup" % (name, proc.returncode))
        if os.path.exists(socket):
            if probe is None:
                return child
            try:
                if probe(child.target):
                    return child
                last = "probe returned false"
            except Exception as e:  # noqa: BLE001 - not up yet
                last = "%s: %s" % (type(e).__name__, e)
        time.sleep(0.05)
    child.kill()
    raise RuntimeError("%s not ready within %g s (last: %s)" % (name, timeout, last))
