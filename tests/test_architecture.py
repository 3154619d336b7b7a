"""The layering of DESIGN.md, enforced: import-linter's contracts in pyproject.toml, checked on an
installed copy of the package (the checkout's folders become helios.autograd, helios.comm, ...
only at install time, so lint-imports cannot read the checkout itself)."""

import fcntl
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The package installed without its native parts into a temporary folder (a few seconds), once
    a run: pytest-xdist's workers share it, under a lock, since two builds at once in the
    checkout's build/ folder trip over each other's files."""
    run_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run_dir = run_dir.parent  # this run's folder, above each worker's own
    site = run_dir / "installed-site"
    with open(run_dir / "installed-site.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (site / ".complete").exists():
            env = dict(os.environ, HELIOS_NO_NATIVE="1")
            r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                                "--no-index", "--target", str(site), ROOT], capture_output=True, text=True, env=env,
                               timeout=300)
            assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
            (site / ".complete").touch()
    return site


def _lint(site, cwd):
    tool = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    if tool is None:
        pytest.skip("import-linter is not installed (scripts/setup.sh --test installs it)")
    env = dict(os.environ, PYTHONPATH=str(site))
    return subprocess.run([tool, "--config", os.path.join(ROOT, "pyproject.toml")], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


def test_the_import_contracts_hold(installed, tmp_path):
    r = _lint(installed, tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_a_broken_layer_is_caught(installed, tmp_path):
    """The contract is not vacuous: autograd reaching for a launcher (as the tape once did) fails it."""
    site = tmp_path / "site"
    shutil.copytree(installed, site)
    tape = site / "helios" / "autograd" / "tape.py"
    tape.write_text(tape.read_text() + "\n\ndef _launch():\n    from helios import _kernels\n    return _kernels\n")
    r = _lint(site, tmp_path)
    assert r.returncode != 0 and "helios.autograd is not allowed to import helios._kernels" in r.stdout, r.stdout[-2000:]
