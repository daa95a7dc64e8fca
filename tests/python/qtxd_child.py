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
dies without running atexit (Linux's parent-death signal, PR_SET_PDEATHSIG).
"""

import atexit
import ctypes
import os
import signal
import subprocess
import threading
import time

_CHILDREN = []
_PR_SET_PDEATHSIG = 1


def _kill_leftovers():
    for proc in _CHILDREN:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


atexit.register(_kill_leftovers)


def _die_with_parent():
    # Runs in the child between fork and exec. The signal comes when the thread
    # that forked exits, hence only for children of the main thread.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


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


def start(qtxd, sock_dir, extra=(), probe=None, name="qtxd", timeout=30):
    """Starts qtxd on <sock_dir>/<name>.sock and waits until probe(target)
    returns a true value (without a probe: until the socket file exists).
    Raises RuntimeError, with the child killed, when qtxd exits during startup
    or is not ready after `timeout` seconds."""
    socket = os.path.join(sock_dir, name + ".sock")
    main = threading.current_thread() is threading.main_thread()
    proc = subprocess.Popen([qtxd, "--socket=" + socket, "--log_level=warn"] + list(extra),
                            preexec_fn=_die_with_parent if main else None)
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
