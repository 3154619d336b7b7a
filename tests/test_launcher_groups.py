"""helios-run keeps an exited rank unreaped (a zombie holding its pid, which is its process group's
id) until it has stopped what the rank started, so its signals never reach a process that was
given the number again (comm/launcher.py: exit_status, _groups_alive, _stop)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from helios.comm import launcher


def _start(code: str) -> subprocess.Popen:
    """A stand-in rank: ``code`` in its own session, as helios-run starts ranks."""
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def _until_exited(p: subprocess.Popen, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while (code := launcher.exit_status(p)) is None:
        assert time.monotonic() < deadline, "the stand-in rank did not exit"
        time.sleep(0.01)
    return code


def _state(pid: int) -> str | None:
    st = launcher.proc_stat(pid)
    return None if st is None else st[0]


def test_an_exited_rank_stays_unreaped_until_reaped_on_purpose():
    p = _start("import sys; sys.exit(3)")
    try:
        assert _until_exited(p) == 3 and _until_exited(p) == 3  # read twice: still there
        assert p.returncode is None and _state(p.pid) == "Z"  # its pid, its group's id, still held
        assert not launcher._groups_alive([p.pid])  # the zombie leader alone is no live group
    finally:
        launcher._reap([p])
    assert p.returncode == 3 and _state(p.pid) is None


def test_a_rank_killed_by_a_signal_reads_as_minus_the_signal():
    p = _start("import time; time.sleep(60)")
    try:
        assert launcher.exit_status(p) is None
        p.send_signal(signal.SIGKILL)
        assert _until_exited(p) == -signal.SIGKILL
    finally:
        launcher._reap([p])
    assert p.returncode == -signal.SIGKILL


def test_stop_ends_what_an_exited_rank_left_in_its_group_then_reaps_it(monkeypatch):
    # the rank starts a child in its group and exits: the group lives on under a zombie leader
    p = _start("import subprocess; subprocess.Popen(['sleep', '60'])")
    try:
        assert _until_exited(p) == 0
        assert launcher._groups_alive([p.pid])  # the child
        launcher._stop([p], grace=2.0, every_group=True)
        assert p.returncode == 0 and not launcher._groups_alive([p.pid]) and _state(p.pid) is None
        sent = []
        monkeypatch.setattr(launcher.os, "killpg", lambda pgid, sig: sent.append((pgid, sig)))
        launcher._signal_groups([p], signal.SIGTERM)  # reaped: its number may be another's now
        assert sent == []
    finally:
        if p.returncode is None:
            launcher._stop([p], grace=0.1, every_group=True)
