"""POSIX shared-memory regions for the qtx Python client.

A ``ShmRegion`` creates (or opens) a POSIX shm object, maps it, and exposes
numpy views of byte ranges, so that tensors travel to qtxd as
``(region, offset, size)`` instead of inline bytes. Register it with
``Client.register_shm_region`` (qtxd must run with ``--allow_client_shm``).
The creator unlinks the object on ``close()``.
"""

import mmap
import os
import secrets

import numpy as np

_SHM_DIR = "/dev/shm"


class ShmRegion:
    """A mapped POSIX shm object. Not safe for concurrent close()."""

    def __init__(self, name, byte_size, shm_name=None, create=True):
        if byte_size <= 0:
            raise ValueError("byte_size=%d: must be > 0" % byte_size)
        self.name = name
        self.shm_name = shm_name or "/qtx-py-%d-%s" % (os.getpid(), secrets.token_hex(6))
        if not self.shm_name.startswith("/") or "/" in self.shm_name[1:]:
            raise ValueError("shm_name=%r: must be '/name' without further '/'" % self.shm_name)
        self.byte_size = byte_size
        self._owner = create
        path = _SHM_DIR + self.shm_name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, byte_size)
            self._map = mmap.mmap(fd, byte_size)
        finally:
            os.close(fd)
        self.buffer = np.frombuffer(self._map, dtype=np.uint8)

    def view(self, offset, dtype, shape):
        """A numpy array of `dtype`/`shape` over bytes [offset, offset + nbytes)."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape)) if len(shape) else 1
        nbytes = count * dtype.itemsize
        if offset < 0 or offset + nbytes > self.byte_size:
            raise ValueError(
                "region '%s': offset %d + size %d exceeds region size %d"
                % (self.name, offset, nbytes, self.byte_size))
        return self.buffer[offset:offset + nbytes].view(dtype).reshape(shape)

    def close(self):
        """Unmaps; the creator also unlinks the shm object."""
        if self._map is None:
            return
        self.buffer = None
        try:
            self._map.close()
        except BufferError:
            pass  # views still alive: the mapping goes with them
        self._map = None
        if self._owner:
            try:
                os.unlink(_SHM_DIR + self.shm_name)
            except FileNotFoundError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
