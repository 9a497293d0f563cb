"""Fixtures of the kvtier package's tests: a real kvtierd on a temp Unix
socket (started from $KVTIERD, which ctest sets, or the repo's build
folders), killed at the end of each test that uses it."""
from __future__ import annotations

import ctypes
import glob
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # the package from the source tree


def _binary(env: str, rel: str) -> str:
    path = os.environ.get(env)
    if path:
        return path
    for cand in sorted(glob.glob(os.path.join(REPO, "build*", rel))):
        if os.access(cand, os.X_OK):
            return cand
    pytest.skip(f"{rel} not built; set {env}")


class Daemon:
    """kvtierd in a temp dir: DRAM pool and NVMe tier sized for tests."""

    def __init__(self, tmp_path, dram_gib="0.0625", nvme_gib="0.125", extra=()):
        self.dir = str(tmp_path)
        os.makedirs(self.dir, exist_ok=True)
        self.data = os.path.join(self.dir, "data")
        self.socket = os.path.join(self.data, "kvtierd.sock")
        self.ready = os.path.join(self.dir, "kvtierd.ready")
        self.log = os.path.join(self.dir, "kvtierd.log")
        self.args = [_binary("KVTIERD", "server/kvtierd"), "--data-dir", self.data,
                     "--dram-gib", dram_gib, "--nvme-gib", nvme_gib, "--hbm-gib", "0",
                     "--dram-populate", "false", "--log-level", "warn", "--ready-file",
                     self.ready, *extra]
        self.proc = None

    def start(self, timeout_s: float = 20.0) -> "Daemon":
        if os.path.exists(self.ready):
            os.unlink(self.ready)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.ready):
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtierd exited with {self.proc.returncode}: "
                                   + open(self.log, errors="replace").read()[-2000:])
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("kvtierd did not become ready in time")
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def pause(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP, returning once every thread of kvtierd is stopped (a signal
        reaches a thread that is running on another core a little later)."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        task_dir = f"/proc/{self.proc.pid}/task"
        while True:
            states = []
            for tid in os.listdir(task_dir):
                try:
                    with open(f"{task_dir}/{tid}/stat") as f:
                        states.append(f.read().rsplit(")", 1)[1].split()[0])
                except FileNotFoundError:
                    pass
            if states and all(s in ("T", "t") for s in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvtierd's threads did not stop: {states}")
            time.sleep(0.01)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


def have_cuda() -> bool:
    """True if torch is installed and sees a CUDA device (torch is imported
    only here, so suites without torch do not pay for it)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def cuda_skip_mark():
    """The mark of a GPU test module (``pytestmark = cuda_skip_mark()``): every
    test is collected and skipped without a GPU (a module-level skip would leave
    pytest nothing to run, which it reports as a failure)."""
    return pytest.mark.skipif(not have_cuda(), reason="needs torch with a CUDA device")


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(tmp_path).start()
    yield d
    d.kill()


@pytest.fixture(scope="module")
def gpu_client(tmp_path_factory):
    """A client of a kvtierd with room for GPU tests (2 GiB DRAM), shared by a
    module; skips unless libkvtier was built with CUDA."""
    import kvtier
    try:
        has_cuda = kvtier.has_cuda()
    except (ImportError, OSError) as e:
        pytest.skip(f"libkvtier: {e}")
    if not has_cuda:
        pytest.skip("libkvtier was built without CUDA")
    d = Daemon(tmp_path_factory.mktemp("kvtierd"), dram_gib="2", nvme_gib="1").start()
    c = kvtier.Client(socket=d.socket)
    yield c
    c.close()
    d.stop()


@pytest.fixture
def kvtier_cli():
    return _binary("KVTIER_CLI", "cli/kvtier")


def corrupt_in_pool(client, key, offset: int = -80) -> None:
    """Flips one byte of a stored chunk in place in the daemon's shared-memory
    pool (bit rot in DRAM), through the client's mapping: by default a V
    payload byte; ``offset`` from the start (or, negative, from the end)."""
    import torch
    with client.get(key) as chunk:
        assert client.uses_shared_memory
        # The view is read-only, the pool mapping under it is MAP_SHARED read-write.
        with warnings.catch_warnings():  # torch warns that the view is not writable
            warnings.simplefilter("ignore", UserWarning)
            view = torch.frombuffer(chunk.data, dtype=torch.uint8)
        address = view.data_ptr()
        del view
        byte = ctypes.c_ubyte.from_address(address + offset % len(chunk.data))
        byte.value ^= 0x40


def eventually(check, timeout_s: float = 20.0, every_s: float = 0.1):
    """Calls ``check`` until it returns a true value (returned) or ``timeout_s``
    passes (AssertionError): for a client's first call on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{check} stayed false for {timeout_s}s")
        time.sleep(every_s)
