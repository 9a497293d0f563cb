"""`pip install` of the package from the repo into a plain venv: the wheel
carries libkvtier.so and works without the source tree."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.dirname(HERE)


def test_pip_install_into_plain_venv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    # Build from a copy: pip builds in the source folder it is given.
    src = tmp_path / "src"
    shutil.copytree(PKG, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__",
                                                            "_lib", "tests"))
    env = dict(os.environ)  # KVTIER_LIBRARY (set by ctest) names the built library
    assert os.path.isfile(env["KVTIER_LIBRARY"])
    subprocess.run([py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(src)],
                   check=True, env=env, cwd=str(tmp_path))
    # Run from elsewhere, without KVTIER_LIBRARY: the installed copy is used.
    clean = {k: v for k, v in os.environ.items() if k not in ("KVTIER_LIBRARY", "PYTHONPATH")}
    out = subprocess.run(
        [py, "-c", "import kvtier, kvtier._native as n; n.load(); print(n.load().path); "
                   "print(kvtier.key_hex(kvtier.prefix_keys('m', range(256))[0])); "
                   "import importlib.metadata as md, os; "
                   "print(kvtier.__version__, md.version('kvtier')); "
                   "print([f for f in ('py.typed', 'torch/_gpu.py', 'integrations/hf/prefix.py') "
                   "if not os.path.isfile(os.path.join(os.path.dirname(kvtier.__file__), f))])"],
        check=True, capture_output=True, text=True, env=clean, cwd=str(tmp_path)).stdout.split()
    assert out[0].startswith(str(venv)) and out[0].endswith("kvtier/_lib/libkvtier.so")
    assert out[1] == "67b5991698bb1566b44b1d6772234280"  # `kvtier keys --model-id m`
    assert out[2] == out[3]  # the version the wheel was built with is kvtier.__version__
    assert out[4:] == ["[]"]  # the typing marker and the subpackages are installed
