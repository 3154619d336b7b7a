"""``helios-doctor``: what this machine can run, and why not.

Exit status: 0 when Helios' default (Vulkan) path can run here, 1 when a required check
failed (no Vulkan device, kernels missing...), 2 for a bad command line.  A probe that
crashes becomes a finding in its section; the command itself never raises.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable

from . import probe_comm, probe_cuda, probe_kernels, probe_python, probe_vulkan
from .report import Section, to_json, to_json_dict, to_text

SECTIONS: dict[str, tuple[str, Callable[[argparse.Namespace], Section]]] = {
    "vulkan": ("Vulkan", lambda a: probe_vulkan.probe()),
    "kernels": ("Kernels (SPIR-V)", lambda a: probe_kernels.probe()),
    "cuda": ("CUDA (PTX backend)", lambda a: probe_cuda.probe(run_ladder=not a.no_ptx)),
    "comm": ("Communication", lambda a: probe_comm.probe()),
    "python": ("Python", lambda a: probe_python.probe()),
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr and exit 2 (no usage dump, no traceback)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    ap = _Parser(prog="helios-doctor", description="Report what this machine can run with Helios, and why not: "
                 "Vulkan (checked against the `vulkan` bindings), kernels, CUDA, communication, Python.")
    ap.add_argument("--json", action="store_true", help="print the report as one JSON object")
    ap.add_argument("--section", action="append", choices=list(SECTIONS), metavar="NAME",
                    help=f"only this section (repeatable): {', '.join(SECTIONS)}")
    ap.add_argument("--no-ptx", action="store_true", help="skip assembling the PTX ladder with ptxas (about a second)")
    ap.add_argument("--no-color", action="store_true", help="no colours (also when NO_COLOR is set or output is not a terminal)")
    return ap.parse_args(argv)


def run_section(name: str, args: argparse.Namespace) -> Section:
    """One section; a probe that raises becomes a failed check naming the error, never a crash."""
    title, fn = SECTIONS[name]
    try:
        return fn(args)
    except Exception as e:  # noqa: BLE001 - the doctor reports, it does not fail
        s = Section(name, title)
        where = traceback.extract_tb(e.__traceback__)[-1]
        s.fail("probe", f"the {name} probe failed: {type(e).__name__}: {e} "
                        f"({os.path.basename(where.filename)}:{where.lineno})",
               "report it with the output of helios-doctor --json")
        return s


def collect(args: argparse.Namespace) -> list[Section]:
    """Every requested section, in the report's order."""
    return [run_section(n, args) for n in SECTIONS if not args.section or n in args.section]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``helios-doctor``."""
    args = parse_args(argv)
    sections = collect(args)
    try:
        if args.json:
            print(to_json(sections))
        else:
            color = not args.no_color and not os.environ.get("NO_COLOR") and sys.stdout.isatty()
            print(to_text(sections, color=color))
        sys.stdout.flush()
    except BrokenPipeError:  # helios-doctor | head: the reader left, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0 if to_json_dict(sections)["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
