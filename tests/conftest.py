"""Shared pytest setup: markers, the skip rules of each test tier, and random draws that do not
depend on the order tests run in."""

import fcntl
import hashlib
import os
import shutil
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

# Under pytest-xdist (scripts/test.sh) each worker has a core: one lavapipe thread each, as the
# multi-rank tests give each rank, instead of every worker's threads contending for both cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("LP_NUM_THREADS", "1")
# Every process a test starts (ranks, launchers, helios-train, benchmarks) imports numpy, whose
# OpenBLAS starts a thread per core that spins a while: 60-110 ms of CPU per process, hundreds
# of processes a run, on cores the other processes need.  The tests' numpy work is small.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# A process missing a kernel's frozen module waits for spirv-opt (kernels_spirv/specialize.py)
# instead of building the unfrozen one and freezing it in the background: on empty caches (CI's
# fresh clone) the ranks of a test all miss the same modules at once.  Measured on four
# training test files with empty caches: 106 s / 187 CPU-s -> 84 s / 146 CPU-s; warm, the same.
os.environ.setdefault("HELIOS_SPECIALIZE", "sync")


def _nvidia_gpu_present() -> bool:
    return os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi") is not None and os.system("nvidia-smi -L >/dev/null 2>&1") == 0


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    if not _nvidia_gpu_present():
        skip_gpu = pytest.mark.skip(reason="no NVIDIA GPU on this machine (gpu tier)")
        for item in items:
            if item.get_closest_marker("gpu"):  # not `in item.keywords`: that holds parameter ids too
                item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _order_free_generators(request):
    """Reseed each numpy Generator that the test's module keeps at module level (``RNG =
    np.random.default_rng(seed)``) from its seed and the test's name, and start Helios' default
    generator where a fresh process starts it (seed 0, offset 0).

    Under pytest-xdist a worker runs whichever tests of a file it is handed, so a test shared
    these generators with a different set of earlier tests each run: its operands, and so its
    rounding errors, changed between runs, and a failure in CI did not reproduce alone.  Now a
    test draws the same numbers alone, in a full run and on either worker."""
    helios = sys.modules.get("helios")
    if helios is not None:  # not imported yet: its generator is still where a process starts it
        helios.manual_seed(0)
    module = getattr(request, "module", None)
    test_key = zlib.crc32(request.node.name.encode())
    for value in vars(module).values() if module else ():
        if isinstance(value, np.random.Generator):
            # In place, so the generator keeps its own seed and anything holding it sees the new state.
            bits = value.bit_generator
            seed = bits.seed_seq.entropy
            seeds = [*seed, test_key] if isinstance(seed, (list, tuple)) else [seed, test_key]
            bits.state = type(bits)(np.random.SeedSequence(seeds)).state


@pytest.fixture
def emulated_cuda(monkeypatch):
    """cuda:0 on the emulated driver for this test; the device current before is current again after it."""
    from helios.runtime import close_device, get_runtime, set_device

    monkeypatch.setenv("HELIOS_CUDA_DEVICE", "emulator")
    before = get_runtime().name
    close_device("cuda:0")
    yield
    set_device(before)
    close_device("cuda:0")  # later tests must not find an emulated cuda:0 already open


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory):
    """``shared_dir(key, make)``: a folder that ``make(folder)`` filled, made once per test session
    for ``key``, whichever worker asks first; the others wait for it and reuse it.

    A module-scoped fixture runs once per pytest-xdist worker that runs a test of its module, and
    the two workers split most modules, so a reference run made in a fixture (a one-rank run, a
    launch of four ranks) was often made twice.  The folder sits under the session's temporary root,
    which the workers share; an advisory lock on ``key.lock`` orders them.  A ``make`` that raises
    leaves no completion mark: the next asker clears the folder and tries again (and fails as the
    test should).  Tests only read the folder (copy it to change it)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    made: dict[str, Path] = {}

    def get(key: str, make) -> Path:
        if key in made:
            return made[key]
        folder = root / "shared" / key
        folder.parent.mkdir(exist_ok=True)
        with open(folder.parent / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if make raises
            if not (folder / ".done").exists():
                shutil.rmtree(folder, ignore_errors=True)  # what a failed make left
                folder.mkdir()
                make(folder)
                (folder / ".done").touch()
        made[key] = folder
        return folder

    return get


@pytest.fixture(scope="session")
def one_rank_run(shared_dir):
    """``one_rank_run(*flags)``: the folder of a one-rank ``helios-train`` run (test_train_dist's
    nano settings plus ``flags``), launched once per session for each distinct set of flags.

    Many multi-rank tests compare N ranks with the same run on one rank; sharing that reference
    keeps the suite inside its time budget.  Tests only read the folder: a test that resumes or
    extends a run copies it first."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_train_dist import launch

    def run(*flags: str):
        def make(out):
            r = launch(1, out, *flags)
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]

        return shared_dir("one_rank-" + hashlib.sha256("\0".join(flags).encode()).hexdigest()[:16], make)

    return run
