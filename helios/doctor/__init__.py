"""helios-doctor: one report of what this machine can run with Helios, and why not.

Sections (each a module with one ``probe()``): Vulkan (loader, devices, what the kernels
need, the device Helios would pick, lavapipe's threads, and the native addon's device
info checked field by field against the ``vulkan`` PyPI bindings), kernels (SPIR-V built
and current, pipeline and shader caches), CUDA (driver, GPUs, ptxas and the PTX ladder),
communication (shared memory, ibverbs, the launcher's environment) and Python.

``helios-doctor`` prints it, ``helios-doctor --json`` prints one JSON object; from code,
:func:`report` returns that object.
"""

from __future__ import annotations

from .cli import main, parse_args
from .report import to_json_dict


def report(argv: list[str] | None = None) -> dict:
    """The report as the dict ``helios-doctor --json`` prints (``argv`` as on the command line, e.g. ["--no-ptx"])."""
    from .cli import collect

    return to_json_dict(collect(parse_args(argv or [])))


__all__ = ["main", "report"]
