"""The device backends Helios can open, registered by kind (``vulkan``, ``cuda``, ...).

Each backend registers itself with :func:`register`: how to open device ``kind:N`` (a
:class:`helios.backend.Runtime`, or a one-line :class:`DeviceError` saying why not and what
to do) and how to list the devices of that kind that exist here.  ``helios.runtime`` names,
opens, lists and chooses devices through this table only, so adding a backend is one module
and one :func:`register` call (docs/device-contract.md, "Adding a backend").  A backend whose
module is costly or may fail to import registers through :func:`register_module`: the module
is imported the first time a device of that kind is opened or listed, and a broken install
of one backend never breaks the others.

``cpu`` is not a backend: it is the host, where tensors only hold data (``helios.runtime.HOST``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from helios.errors import DeviceError


@dataclass(frozen=True)
class DeviceInfo:
    """One device as ``helios.devices()`` lists it."""

    name: str  # "vulkan:N" or "cuda:N"
    description: str
    type: str  # discrete | integrated | virtual | cpu | other
    info: dict

    def __repr__(self) -> str:
        return f"<{self.name}: {self.description} ({self.type})>"


@dataclass(frozen=True)
class Backend:
    """One kind of device: ``open(index)`` -> Runtime (or DeviceError), ``list()`` -> the
    :class:`DeviceInfo` of every device of the kind here (raises DeviceError when the
    backend cannot run at all: that error says what to install)."""

    kind: str
    open: Callable
    list: Callable


_BACKENDS: dict[str, Backend] = {}


def register(kind: str, open: Callable, list: Callable) -> None:  # noqa: A002 - the contract's words
    """Register (or replace) the backend of device ``kind``; kinds are listed in registration order."""
    if not kind.isidentifier() or kind == "cpu":
        raise ValueError(f"register: a backend kind is an identifier other than 'cpu', got {kind!r}")
    _BACKENDS[kind] = Backend(kind, open, list)


def register_module(kind: str, module: str) -> None:
    """Register the backend ``kind`` whose ``open_device(index)`` and ``list_devices()`` live in
    ``module``, imported on first use.  An import failure becomes the DeviceError of that kind."""

    def entry(name: str) -> Callable:
        def call(*args):
            try:
                mod = importlib.import_module(module)
            except Exception as e:  # noqa: BLE001 - a broken backend must not break the others
                raise DeviceError(f"cannot import the {kind} backend {module} ({type(e).__name__}: {e})") from None
            return getattr(mod, name)(*args)

        return call

    register(kind, entry("open_device"), entry("list_devices"))


def kinds() -> tuple[str, ...]:
    """The registered device kinds, in registration order."""
    return tuple(_BACKENDS)


def backend(kind: str) -> Backend:
    """The backend of ``kind``; KeyError names the registered kinds."""
    try:
        return _BACKENDS[kind]
    except KeyError:
        raise KeyError(f"no device backend {kind!r}; registered: {', '.join(_BACKENDS)}") from None


def spellings() -> str:
    """How devices are named, for error messages: "'cpu', 'vulkan', 'vulkan:N', 'cuda' or 'cuda:N'"."""
    names = ["'cpu'"] + [f"'{k}', '{k}:N'" for k in _BACKENDS]
    text = ", ".join(names)
    head, sep, last = text.rpartition(", ")
    return f"{head} or {last}" if sep else text


__all__ = ["Backend", "DeviceInfo", "backend", "kinds", "register", "register_module", "spellings"]
