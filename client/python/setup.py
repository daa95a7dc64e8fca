"""Builds the qtx Python package: generates the qtx.v1 stubs from proto/ at
build time, then packages them with the wrapper.

    /usr/bin/python3 -m pip install --no-build-isolation client/python
    (Debian 12: add --break-system-packages, or use a venv / --target DIR)

The stubs come from protoc + grpc_python_plugin (Debian: protobuf-compiler,
protobuf-compiler-grpc), which match Debian's python3-protobuf 3.21 and
python3-grpcio 1.51; without them from grpc_tools.protoc (a grpcio-tools
recent enough for proto3 `optional`: Debian's 1.14 is not). The proto folder
is ../../proto, or $QTX_PROTO_DIR.
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


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        generate(self.build_lib)


setup(
    name="qtx",
    version="0.1.0",
    description="Python client for the qtxd block-scaled FP8 sidecar (qtx.v1)",
    packages=["qtx"],
    python_requires=">=3.9",
    install_requires=["grpcio", "protobuf", "numpy"],
    cmdclass={"build_py": BuildPyWithStubs},
)
