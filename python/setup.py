"""Builds the kvtier wheel with libkvtier.so inside it (kvtier/_lib/).

The library comes from $KVTIER_LIBRARY, or from the CMake build of the
source tree this package sits in ($KVTIER_BUILD_DIR, default ../build), which
is configured and built (target kvtier_c) when the library is not there yet.
The C++ dependencies are the Debian packages of scripts/install-deps; the
wheel links them dynamically, so it is for the machine it was built on.
"""
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _library() -> str:
    env = os.environ.get("KVTIER_LIBRARY")
    if env:
        if not os.path.isfile(env):
            raise SystemExit(f"KVTIER_LIBRARY={env} does not exist")
        return env
    build = os.environ.get("KVTIER_BUILD_DIR", os.path.join(REPO, "build"))
    lib = os.path.join(build, "client", "libkvtier.so")
    if not os.path.isfile(lib):
        if not os.path.isfile(os.path.join(REPO, "CMakeLists.txt")):
            raise SystemExit("libkvtier.so not found: set KVTIER_LIBRARY or build from the "
                             "kvtier source tree")
        subprocess.check_call(["cmake", "-S", REPO, "-B", build, "-G", "Ninja",
                               "-DCMAKE_BUILD_TYPE=RelWithDebInfo"])
        subprocess.check_call(["cmake", "--build", build, "--target", "kvtier_c"])
    return lib


class BuildPyWithLibrary(build_py):
    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "kvtier", "_lib")
        os.makedirs(dest, exist_ok=True)
        shutil.copy2(_library(), os.path.join(dest, "libkvtier.so"))


class BinaryDistribution(Distribution):
    def has_ext_modules(self):  # a platform wheel: it carries a shared library
        return True


setup(cmdclass={"build_py": BuildPyWithLibrary}, distclass=BinaryDistribution)
