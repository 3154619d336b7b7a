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


# -- private names stay in their package ------------------------------------------------------------

# The checkout's folders and the packages they become (pyproject.toml's package-dir).
_PACKAGE_DIRS = {"helios": "helios", "autograd": "helios.autograd", "comm": "helios.comm",
                 "cuda_ptx": "helios.cuda_ptx", "kernels_spirv": "helios.kernels_spirv", "profile": "helios.profile",
                 "schedule": "helios.schedule"}


def _module_file(module: str) -> str | None:
    """The checkout path of module or package ``module`` (helios.comm.api -> comm/api.py), or None."""
    for folder, package in sorted(_PACKAGE_DIRS.items(), key=lambda kv: -len(kv[1])):
        if module == package or module.startswith(package + "."):
            rest = module[len(package):].lstrip(".").replace(".", os.sep)
            base = os.path.join(ROOT, folder, rest)
            for path in (base + ".py", os.path.join(base, "__init__.py")):
                if os.path.exists(path):
                    return path
            return None
    return None


_NATIVE = ("helios._vulkan", "helios.comm._shm")  # setup.py's extension modules (built or not)


def _is_module(module: str, name: str) -> bool:
    """Whether ``module.name`` is a module (a private submodule such as helios._kernels, or a native
    extension) rather than a private global."""
    return f"{module}.{name}" in _NATIVE or _module_file(f"{module}.{name}") is not None


# Packages whose modules share underscore helpers among themselves by design (the kernel layer, and
# the ops' common checks); outside them a private name stays in its module.
_SHARING = ("helios._kernels", "helios.functional")


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _private_reads(path: str, module_name: str) -> list[str]:
    """``from X import _name`` and ``X._name`` (X an imported Helios module) in the module
    ``module_name`` at ``path``, where X is another module, not one of the same sharing package,
    and ``X._name`` is not a module."""
    import ast

    tree = ast.parse(open(path).read())
    is_package = path.endswith("__init__.py")
    parts = module_name.split(".")
    aliases, found = {}, []

    def resolve(node) -> str:
        if node.level == 0:
            return node.module or ""
        base = parts if is_package else parts[:-1]
        base = base[:len(base) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))

    def foreign(module: str, name: str) -> bool:
        if not name.startswith("_") or name.startswith("__") or not module.startswith("helios"):
            return False
        if module == module_name or any(_in(module, p) and _in(module_name, p) for p in _SHARING):
            return False
        return not _is_module(module, name)

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = resolve(node)
            for a in node.names:
                if module.startswith("helios") and _module_file(f"{module}.{a.name}") is not None:
                    aliases[a.asname or a.name] = f"{module}.{a.name}"
                if foreign(module, a.name):
                    found.append(f"{path}:{node.lineno}: from {module} import {a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("helios"):
                    aliases[a.asname or a.name] = a.name if a.asname else "helios"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            module = aliases[node.value.id]
            if foreign(module, node.attr):
                found.append(f"{path}:{node.lineno}: {node.value.id}.{node.attr} ({module})")
    return found


def _library_modules():
    """(path, module name) of every Python file of the package, from the checkout's folders."""
    for folder, package in _PACKAGE_DIRS.items():
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and (folder != "helios" or d not in _PACKAGE_DIRS)]
            rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
            pkg = package if rel == "." else package + "." + rel.replace(os.sep, ".")
            for f in sorted(files):
                if f.endswith(".py"):
                    yield os.path.join(dirpath, f), pkg if f == "__init__.py" else f"{pkg}.{f[:-3]}"


def test_no_module_reads_another_modules_private_names():
    """DESIGN.md's rule that layers talk through public functions: a leading underscore is private to
    its module (the modules of helios._kernels and of helios.functional share helpers among themselves)."""
    found = [hit for path, name in _library_modules() for hit in _private_reads(path, name)]
    assert not found, "private names read across modules (make them public, with a docstring):\n" + "\n".join(found)


def test_a_private_read_is_caught(tmp_path):
    """The check is not vacuous: autocast asking the tape's private state (as it once did) is found."""
    src = tmp_path / "amp.py"
    src.write_text("from helios.autograd import tape\n\n\ndef f():\n    return tape._state\n")
    assert _private_reads(str(src), "helios.amp") == [f"{src}:5: tape._state (helios.autograd.tape)"]
    src.write_text("from helios.dtypes import _BY_NAME\n")
    assert _private_reads(str(src), "helios.device_transfer") == [f"{src}:1: from helios.dtypes import _BY_NAME"]
    src.write_text("from helios import _kernels\nfrom helios._kernels.core import _split\n")
    assert _private_reads(str(src), "helios._kernels.gemm") == []  # a private module; the kernel layer's own helper


# -- a Tensor's internals stay in the tensor core ------------------------------------------------------

# helios.Tensor's private slots (tensor.py) and the attributes the tape and fused optimizers set.
_TENSOR_INTERNALS = frozenset({"_st", "_strides", "_off", "_host", "_node", "_grad_slot", "_grad_hooks",
                               "_out_index", "_history"})
# What a Tensor is made of and made by: the class, autograd, the kernels and the ops, the copies between
# devices and the capture, which keep the host copy (``_host``) coherent with the device's writes.
_TENSOR_CORE = ("helios.tensor", "helios.autograd", "helios._kernels", "helios.functional", "helios.device_transfer",
                "helios.graph")


def _tensor_internal_reads(path: str) -> list[str]:
    """``x._st``, ``x._off``, ... (a Tensor's private attributes) on anything but ``self`` in the file at ``path``."""
    import ast

    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Attribute) and node.attr in _TENSOR_INTERNALS and not (
                isinstance(node.value, ast.Name) and node.value.id == "self"):
            found.append(f"{path}:{node.lineno}: .{node.attr}")
    return found


def test_only_the_tensor_core_touches_a_tensors_internals():
    """Outside the tensor core (nn, optim, amp, attention, models, the training step, comm, the
    schedules) a tensor is used through its public API: ``untyped_storage()`` (its Storage's ``rt``,
    ``handle``, ``version``), ``storage_offset()``, ``stride()``, ``grad_slot``, ``set_``, ``.data``."""
    found = [hit for path, name in _library_modules() if not any(_in(name, p) for p in _TENSOR_CORE)
             for hit in _tensor_internal_reads(path)]
    assert not found, "a Tensor's internals read outside the tensor core (use its public API):\n" + "\n".join(found)


def test_a_tensor_internal_read_is_caught(tmp_path):
    """The check is not vacuous: the optimizer's old reads (``p._st.rt``, ``p._grad_slot``) are found, a
    class's own ``self._node`` is not."""
    src = tmp_path / "optim.py"
    src.write_text("def f(p, fg):\n    rt = p._st.rt\n    fg.copy(p._grad_slot)\n    return self._node\n")
    assert _tensor_internal_reads(str(src)) == [f"{src}:2: ._st", f"{src}:3: ._grad_slot"]
