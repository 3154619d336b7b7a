"""The op being recorded: what each kernel a backend launches is attributed to.

Two consumers need to know, at the moment a backend records a dispatch, which user-level op
(``matmul``, ``layer_norm``...) it belongs to:

* ``HELIOS_DEBUG`` kernel lines show the op's operand shapes and dtype: autograd's
  ``Function.apply`` notes them (:func:`note_operands`) while :attr:`OpTrace.notes_on` is
  set, which a runtime that logs kernels turns on (:func:`enable_operand_notes`);
* the profiler's trace links each host op to its kernels: while a profiling session records
  an op, autograd opens a list (:func:`collect_dispatch_ids`) and every backend files the
  sequence number of each dispatch there (:func:`file_dispatch`), else records the dispatch
  as an op of its own.

This module is that state's one home, reached through these public functions by the layers
that set it (autograd, the elementwise fusion queue) and the backends that read it, so no
layer touches another's private globals.  :func:`current` returns the one process-wide
:class:`OpTrace`; its fields are read directly on hot paths.
"""

from __future__ import annotations


class OpTrace:
    """The op being recorded: ``notes_on`` (whether ops note their operands), ``operands``
    ((shapes text, dtype name) of the op, for HELIOS_DEBUG lines), ``dispatch_ids`` (the list the
    op's dispatch sequence numbers go to while the profiler records it, else None)."""

    __slots__ = ("notes_on", "operands", "dispatch_ids")

    def __init__(self) -> None:
        self.notes_on = False
        self.operands: tuple = ("", "")
        self.dispatch_ids: list | None = None


_CURRENT = OpTrace()


def current() -> OpTrace:
    """The process-wide op trace (one object for the life of the process)."""
    return _CURRENT


def enable_operand_notes() -> None:
    """Make every op note its operands from now on (a runtime that prints HELIOS_DEBUG lines)."""
    _CURRENT.notes_on = True


def note_operands(text: tuple) -> None:
    """(shapes text, dtype name) of the op being recorded, for the HELIOS_DEBUG kernel lines."""
    _CURRENT.operands = text


def collect_dispatch_ids(ids: list | None) -> list | None:
    """File the sequence numbers of the dispatches recorded from now on into ``ids`` (None: record
    each as its own host op); returns the list that was collecting before, to restore it."""
    prev, _CURRENT.dispatch_ids = _CURRENT.dispatch_ids, ids
    return prev


def file_dispatch(seq: int) -> bool:
    """File a dispatch's sequence number with the op being recorded; False when no op collects
    them (the backend then records the dispatch as a host op of its own)."""
    ids = _CURRENT.dispatch_ids
    if ids is None:
        return False
    ids.append(seq)
    return True


__all__ = ["OpTrace", "collect_dispatch_ids", "current", "enable_operand_notes", "file_dispatch", "note_operands"]
