"""Builds the qtx Python package: generates the qtx.v1 stubs from proto/ at
build time, then packages them with the wrapper.

    /usr/bin/python3 -m pip install --no-build-isolation client/python
    (Debian 12: add --break-system-packages, or use a venv / --target DIR)

The stubs come from protoc + grpc_python_plugin (Debian: protobuf-compiler,
protobuf-compiler-grpc), which match Debian's python3-protobuf 3.21 and
python3-grpcio 1.51; without them from grpc_tools.protoc (a grpcio-tools
recent enough for proto3 `optional`: Debian's 1.14 is not). The proto folder
is ../../proto, or $QTX_PROTO_DIR.

The compiled qtx._native (qtx.cuda) is built by the repository's CMake
project, the same target CI builds (qtx_native), for the Python running pip:
when the qtx source tree is found ($QTX_SOURCE_DIR, else ../..) and CUDA is
there, setup.py configures it in $QTX_NATIVE_BUILD_DIR (default: setuptools'
build_temp) with -DPython3_EXECUTABLE=<this python> and builds qtx_native into
the package. QTX_BUILD_NATIVE=0 skips it (qtx.cuda then raises ImportError
naming the missing module); QTX_NATIVE_PREBUILT=<path to _native*.so> copies
a module built elsewhere instead. A build failure fails the install.
"""

import glob
import os
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def proto_dir():
    d = os.environ.get("QTX_PROTO_DIR") or os.path.join(HERE, "..", "..", "proto")
    d = os.path.abspath(d)
    if not glob.glob(os.path.join(d, "qtx", "v1", "*.proto")):
        sys.exit("qtx setup: no qtx/v1/*.proto under %s (set QTX_PROTO_DIR)" % d)
    return d


def generate(out_dir):
    src = proto_dir()
    protos = sorted(glob.glob(os.path.join(src, "qtx", "v1", "*.proto")))
    os.makedirs(os.path.join(out_dir, "qtx", "v1"), exist_ok=True)
    protoc = shutil.which("protoc")
    plugin = shutil.which("grpc_python_plugin")
    if protoc and plugin:
        cmd = [protoc, "--proto_path=" + src, "--python_out=" + out_dir,
               "--grpc_python_out=" + out_dir, "--plugin=protoc-gen-grpc_python=" + plugin]
    else:
        cmd = [sys.executable, "-m", "grpc_tools.protoc", "--proto_path=" + src,
               "--python_out=" + out_dir, "--grpc_python_out=" + out_dir]
    subprocess.check_call(cmd + protos)
    open(os.path.join(out_dir, "qtx", "v1", "__init__.py"), "a").close()


def source_dir():
    d = os.environ.get("QTX_SOURCE_DIR") or os.path.join(HERE, "..", "..")
    d = os.path.abspath(d)
    if os.path.exists(os.path.join(d, "client", "python", "native", "qtx_native.cc")):
        return d
    return None


def build_native(out_dir, build_temp):
    """Builds qtx._native into out_dir/qtx (see the module doc)."""
    prebuilt = os.environ.get("QTX_NATIVE_PREBUILT")
    if prebuilt:
        shutil.copy(prebuilt, os.path.join(out_dir, "qtx", os.path.basename(prebuilt)))
        return
    if os.environ.get("QTX_BUILD_NATIVE", "1") == "0":
        return
    src = source_dir()
    if src is None:
        print("qtx setup: no qtx source tree (set QTX_SOURCE_DIR): qtx._native not built")
        return
    if not os.path.isdir(os.environ.get("CUDA_HOME", "/usr/local/cuda")):
        print("qtx setup: no CUDA toolkit: qtx._native not built (qtx.cuda unavailable)")
        return
    bdir = os.path.abspath(os.environ.get("QTX_NATIVE_BUILD_DIR") or
                           os.path.join(build_temp, "qtx-native"))
    cmake = shutil.which("cmake") or sys.exit("qtx setup: cmake is needed for qtx._native")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.check_call([cmake, "-S", src, "-B", bdir] + gen + [
        "-DCMAKE_BUILD_TYPE=Release", "-DQTX_BUILD_TESTS=OFF", "-DQTX_BUILD_BENCH=OFF",
        "-DPython3_EXECUTABLE=" + sys.executable,
        "-DQTX_NATIVE_OUTPUT_DIR=" + os.path.join(os.path.abspath(out_dir), "qtx")])
    jobs = os.environ.get("QTX_BUILD_JOBS", "2")
    subprocess.check_call([cmake, "--build", bdir, "--target", "qtx_native", "-j", jobs])


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        generate(self.build_lib)
        build_native(self.build_lib, self.get_finalized_command("build").build_temp)


setup(
    name="qtx",
    version="0.1.0",
    description="Python client for the qtxd block-scaled FP8 sidecar (qtx.v1)",
    packages=["qtx"],
    python_requires=">=3.9",
    # Tested with: grpcio 1.51.1, protobuf 4.21.12 (python3-protobuf 3.21), numpy
    # 1.24.2 (Debian 12); torch 1.13 (CPU, Debian) and 2.11.0+cu130, cupy 14.2.0
    # (GPU host). torch and cupy are optional (qtx.cuda imports neither).
    install_requires=["grpcio>=1.51,<2", "protobuf>=3.21,<5", "numpy>=1.24,<3"],
    extras_require={"torch": ["torch>=1.13,<=2.11.0"], "cupy": ["cupy-cuda13x>=14.2,<15"]},
    cmdclass={"build_py": BuildPyWithStubs},
)
