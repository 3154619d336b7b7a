"""Field-by-field comparison of the native addon's device dicts with the bindings' recomputation."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Disagreement:
    """One field on which the addon and the bindings differ (``device`` is "vulkan:N")."""

    device: str
    field: str
    addon: object
    bindings: object

    def text(self) -> str:
        """One line for the report."""
        return f"{self.device} {self.field}: the addon says {self.addon!r}, the vulkan bindings say {self.bindings!r}"

    def as_dict(self) -> dict:
        """JSON form."""
        return asdict(self)


def _norm(v):
    # pybind11 hands tuples where the bindings build lists; the values, not the container, matter.
    if isinstance(v, (tuple, list)):
        return [_norm(x) for x in v]
    return v


def _same(a, b) -> bool:
    a, b = _norm(a), _norm(b)
    if isinstance(a, float) or isinstance(b, float):
        # timestampPeriod is a C float in both; allow for a float->double round trip, nothing more.
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-12)
        except (TypeError, ValueError):
            return False
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) == bool(b) and type(a) in (bool, int) and type(b) in (bool, int)
    return a == b


def _walk(prefix: str, addon: dict, other: dict, device: str, out: list, unchecked: list) -> None:
    for key, av in addon.items():
        path = f"{prefix}{key}"
        if key not in other:
            unchecked.append(path)  # a field the doctor does not know how to recompute yet
            continue
        bv = other[key]
        if isinstance(av, dict) and isinstance(bv, dict):
            _walk(path + ".", av, bv, device, out, unchecked)
        elif not _same(av, bv):
            out.append(Disagreement(device, path, _norm(av), _norm(bv)))


def compare(addon_devices: list[dict], bindings_devices: list[dict]) -> tuple[list[Disagreement], list[str]]:
    """(disagreements, unchecked fields) between the addon's ``enumerate_devices()`` and the bindings'.

    Devices are paired by position, since both sides sort them by the same rule; a device
    only one side lists is a disagreement on ``present``.  Every field of the addon's dict
    is compared, nested dicts included, except ``extra`` on the bindings' side (fields the
    addon does not report); fields the addon has and the bindings lack are returned as
    unchecked, not as disagreements."""
    out: list[Disagreement] = []
    unchecked: list[str] = []
    for i in range(max(len(addon_devices), len(bindings_devices))):
        a = addon_devices[i] if i < len(addon_devices) else None
        b = bindings_devices[i] if i < len(bindings_devices) else None
        dev = f"vulkan:{i}"
        if a is None or b is None:
            out.append(Disagreement(dev, "present", a is not None and a.get("name"), b is not None and b.get("name")))
            continue
        _walk("", a, {k: v for k, v in b.items() if k != "extra"}, dev, out, unchecked)
    return out, sorted(set(unchecked))


def count_fields(d: dict) -> int:
    """Leaf fields of a device dict (nested dicts counted through), for the report's "agree on N fields"."""
    return sum(count_fields(v) if isinstance(v, dict) else 1 for v in d.values())
