"""python -m qtx health [--target unix:///tmp/qtxd.sock] [--timeout 5] [--wait 60]

A quick check of an installed qtx: asks qtxd's health service and prints its
serving status and which parts of the package are usable (the compiled
qtx._native for qtx.cuda, grpcio for qtx.Client). With --wait S it first waits
up to S seconds for qtxd to be SERVING (a trainer's start-up script waiting for
its sidecar). Exit status 0 when qtxd answers SERVING, 1 otherwise, 2 on bad
usage."""

import argparse
import sys


def _health(target, timeout, wait):
    """(status, via) using qtx._native when built, else qtx.Client; after
    waiting up to `wait` seconds for SERVING when wait > 0."""
    try:
        from qtx import _native
    except ImportError:
        _native = None
    if _native is not None:
        s = _native.Session(target, "host", "health", float(timeout))
        if wait > 0:
            s.wait_until_serving(float(wait))
        return s.health(), "qtx._native (C++ client)"
    import qtx
    with qtx.Client(target, timeout=timeout) as c:
        if wait > 0:
            c.wait_until_serving(wait)
        return c.health(), "qtx.Client (grpcio)"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m qtx", description=__doc__.split("\n\n")[1])
    p.add_argument("command", choices=["health"])
    p.add_argument("--target", default="unix:///tmp/qtxd.sock")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--wait", type=float, default=0.0,
                   help="first wait up to this many seconds for SERVING (0: ask once)")
    args = p.parse_args(argv)
    if args.wait < 0:
        p.error("--wait %g: must not be negative" % args.wait)
    import qtx
    from qtx import errors
    parts = []
    try:
        from qtx import _native  # noqa: F401
        parts.append("qtx.cuda: yes")
    except ImportError as e:
        parts.append("qtx.cuda: no (%s)" % e)
    parts.append("qtx.Client: %s" % ("yes" if getattr(qtx, "_GRPC_MISSING", None) is None
                                      else "no (%s)" % qtx._GRPC_MISSING))
    try:
        status, via = _health(args.target, args.timeout, args.wait)
    except errors.QtxError as e:
        print("%s: %s [%s]" % (args.target, e, "; ".join(parts)))
        return 1
    print("%s: %s via %s [%s]" % (args.target, status, via, "; ".join(parts)))
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
