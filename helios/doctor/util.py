"""Small helpers shared by the probes: sizes, human-readable bytes, tool versions."""

from __future__ import annotations

import os
import re
import subprocess


def human_bytes(n: int | None) -> str:
    """``n`` bytes as "1.5 GiB" (binary units, as Vulkan and the kernel report memory)."""
    if n is None:
        return "?"
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{int(v)} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{n} B"  # pragma: no cover - the loop always returns


def dir_usage(path: str) -> tuple[int, int]:
    """(files, bytes) under ``path`` (0, 0 when it does not exist); unreadable entries are skipped."""
    files = total = 0
    for root, _dirs, names in os.walk(path, onerror=lambda e: None):
        for n in names:
            try:
                total += os.lstat(os.path.join(root, n)).st_size
                files += 1
            except OSError:
                pass
    return files, total


def tool_version(path: str, timeout: float = 10.0) -> str:
    """The release of ``path --version`` as NVIDIA's tools print it ("V13.0.88"), else its last non-empty line."""
    r = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=timeout, check=False)
    text = r.stdout + r.stderr
    m = re.search(r"\bV\d+\.\d+\.\d+", text)
    if m:
        return m.group(0)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit {r.returncode}"


def cpu_count() -> int:
    """CPUs this process may run on (the affinity mask, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
