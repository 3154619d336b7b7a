"""The report's data model: checks grouped in sections, rendered as text or as one JSON object.

A :class:`Check` is one line of the report.  Its status is ``ok`` (✓), ``fail`` (✗) or
``info`` (·, a fact with no verdict, such as a device's memory heaps).  A failed check
carries ``advice``: one line saying what to do (the package to install, the variable to
set).  ``required`` marks the failures that stop Helios' default path (no Vulkan device,
kernels missing); the others only close an optional path (CUDA, RDMA, the bindings).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

SCHEMA_VERSION = 1
MARKS = {"ok": "✓", "fail": "✗", "info": "·"}


@dataclass
class Check:
    """One verdict (or fact) of the report."""

    name: str
    status: str  # ok | fail | info
    summary: str
    advice: str = ""
    required: bool = False

    def __post_init__(self) -> None:
        if self.status not in MARKS:
            raise ValueError(f"check {self.name!r}: status {self.status!r} is not one of {sorted(MARKS)}")


@dataclass
class Section:
    """A titled group of checks plus the raw facts they were judged from (``data``, for --json)."""

    name: str
    title: str
    checks: list[Check] = field(default_factory=list)
    data: dict = field(default_factory=dict)

    def ok(self, name: str, summary: str) -> Check:
        """Append a passed check."""
        return self._add(Check(name, "ok", summary))

    def fail(self, name: str, summary: str, advice: str, required: bool = False) -> Check:
        """Append a failed check with its one-line advice."""
        return self._add(Check(name, "fail", summary, advice, required))

    def info(self, name: str, summary: str) -> Check:
        """Append a fact that is neither good nor bad."""
        return self._add(Check(name, "info", summary))

    def _add(self, c: Check) -> Check:
        self.checks.append(c)
        return c

    @property
    def failed(self) -> list[Check]:
        """The checks of this section that failed."""
        return [c for c in self.checks if c.status == "fail"]


def to_json_dict(sections: list[Section]) -> dict:
    """The whole report as one JSON-ready dict: sections by name, and every failure in ``findings``."""
    findings = [dict(section=s.name, **asdict(c)) for s in sections for c in s.failed]
    return {
        "schema": SCHEMA_VERSION,
        "ok": not any(f["required"] for f in findings),
        "findings": findings,
        "sections": {s.name: {"title": s.title, "ok": not s.failed,
                              "checks": [asdict(c) for c in s.checks], "data": s.data} for s in sections},
    }


def to_json(sections: list[Section]) -> str:
    """:func:`to_json_dict` serialised (values JSON lacks, such as bytes, become strings)."""
    return json.dumps(to_json_dict(sections), indent=2, default=str, ensure_ascii=False)


def to_text(sections: list[Section], color: bool = False) -> str:
    """The readable report: a heading per section, one line per check, advice under each ✗."""
    paint = {"ok": "\033[32m", "fail": "\033[31m", "info": ""} if color else {}
    reset = "\033[0m" if color else ""
    lines: list[str] = []
    for s in sections:
        mark = MARKS["fail"] if s.failed else MARKS["ok"]
        lines.append(f"{mark} {s.title}")
        for c in s.checks:
            col = paint.get(c.status, "")
            lines.append(f"  {col}{MARKS[c.status]}{reset if col else ''} {c.name}: {c.summary}")
            if c.status == "fail" and c.advice:
                lines.append(f"      -> {c.advice}")
        lines.append("")
    failed = [c for s in sections for c in s.failed]
    required = [c for c in failed if c.required]
    if required:
        lines.append(f"{MARKS['fail']} Helios cannot run its default (Vulkan) path here: "
                     f"{len(required)} required check(s) failed, {len(failed)} finding(s) in all.")
    elif failed:
        lines.append(f"{MARKS['ok']} Helios can run here; {len(failed)} finding(s) close optional paths (see the ✗ lines).")
    else:
        lines.append(f"{MARKS['ok']} every check passed.")
    return "\n".join(lines)
