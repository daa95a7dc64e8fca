"""Probe (GPU host, PyTorch): what the CUDA driver reports for tensors of
PyTorch's caching allocator under a given PYTORCH_CUDA_ALLOC_CONF, i.e. what
qtx::cuda::RegionCache will see: CUDA IPC capable or not, pool or not, VMM
chunks (cuMemGetAddressRange per chunk) and their requestedHandleTypes.
Prints one JSON line per tensor. Run with the allocator setting in the
environment, e.g.
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 scripts/torch_vmm_probe.py
"""
import ctypes
import json
import os

import torch

cuda = ctypes.CDLL("libcuda.so.1")
CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE = 17
POSIX_FD, FABRIC = 0x1, 0x8


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Prop(ctypes.Structure):  # CUmemAllocationProp (CUDA 12/13 layout)
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


def attr(ptr, which, ctype):
    v = ctype()
    r = cuda.cuPointerGetAttribute(ctypes.byref(v), which, ctypes.c_ulonglong(ptr))
    return v.value if r == 0 else f"err{r}"


def chunks(ptr, nbytes):
    out, at, end = [], ptr, ptr + nbytes
    while at < end:
        base, size = ctypes.c_ulonglong(), ctypes.c_size_t()
        if cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                        ctypes.c_ulonglong(at)) != 0:
            out.append("gap")
            break
        out.append((base.value, size.value))
        at = base.value + size.value
    return out


def probe(name, t):
    ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
    rec = {"conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "tensor": name,
           "bytes": nbytes,
           "ipc_capable": attr(ptr, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, ctypes.c_int),
           "pool": bool(attr(ptr, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, ctypes.c_void_p))}
    h = ctypes.c_ulonglong()
    r = cuda.cuMemRetainAllocationHandle(ctypes.byref(h), ctypes.c_void_p(ptr))
    rec["retain_allocation_handle"] = r
    if r == 0:
        p = Prop()
        cuda.cuMemGetAllocationPropertiesFromHandle(ctypes.byref(p), h)
        rec["requested_handle_types"] = p.requestedHandleTypes
        rec["posix_fd"] = bool(p.requestedHandleTypes & POSIX_FD)
        rec["fabric"] = bool(p.requestedHandleTypes & FABRIC)
        cuda.cuMemRelease(h)
        cs = chunks(ptr, nbytes)
        rec["chunks"] = len(cs)
        rec["chunk_sizes_mib"] = sorted({c[1] >> 20 for c in cs if c != "gap"})
    print(json.dumps(rec), flush=True)


torch.cuda.init()
print(json.dumps({"torch": torch.__version__}), flush=True)
small = torch.empty(1000, device="cuda")
big = torch.empty(30 << 20, device="cuda", dtype=torch.uint8)
bigger = torch.empty(100 << 20, device="cuda", dtype=torch.bfloat16)
for n, t in (("small_4KB", small), ("big_30MiB", big), ("bigger_200MiB", bigger)):
    probe(n, t)
