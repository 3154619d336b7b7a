"""A communicator: one transport, ordered execution, sequence numbers, poisoning, debug checks.

Operations run in the order they were issued.  A blocking call with nothing queued runs
on the caller's thread (no hand-off latency); otherwise, and for ``async_op=True``, it
goes to the communicator's worker thread and a :class:`Work` handle tracks it.  Any
failure inside an operation aborts the transport (peers' waits end at once instead of at
their deadline) and poisons the communicator: every later call raises CommError until
the process group is re-created.

While a profiling session is open (``helios.profile.profile()``), every operation is
recorded in its collector (``Collector.record_comm``): name, group, sequence number, bytes,
host start and end, the thread it ran on, whether it was issued with ``async_op=True``.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from helios.comm import algorithms as A
from helios.comm import cost
from helios.comm.buffers import take_device_ready_ns
from helios.comm.engine import Engine, Fault, OpInfo, PeerLost
from helios.profile.profiler import current_collector

from helios.errors import CommError

ALGORITHMS = ("auto", "ring", "tree", "halving_doubling", "hierarchical")
_DEBUG_STEP = 0x8000
_DESC = 160


class Work:
    """Handle of an asynchronous operation: ``wait()`` blocks until done and re-raises its error."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._ev = threading.Event()
        self._exc: BaseException | None = None

    def _finish(self, exc: BaseException | None) -> None:
        self._exc = exc
        self._ev.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the operation is done (True), or ``timeout`` passes (False); raise its error."""
        if not self._ev.wait(timeout):
            return False
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        """Whether the operation has finished (successfully or not)."""
        return self._ev.is_set()


@dataclass
class CommCounters:
    """What a communicator has done since it was created: per operation name, the calls and
    their operand bytes (``payload``, as the caller sees them), and the bytes this rank put
    on the wire for its peers (``bytes_sent``: handed to the TCP/ibverbs links, or written
    into its shared-memory slots for the peers to read).  A ring all-reduce of S bytes on n
    ranks sends 2(n-1)/n x S; a compressed one, far less."""

    calls: dict[str, int] = field(default_factory=dict)
    payload_bytes: dict[str, int] = field(default_factory=dict)
    bytes_sent: int = 0

    def snapshot(self) -> dict:
        """A copy, as plain data: ``{"calls": {...}, "payload_bytes": {...}, "bytes_sent": n}``."""
        return {"calls": dict(self.calls), "payload_bytes": dict(self.payload_bytes), "bytes_sent": self.bytes_sent}


class ProcessGroup:
    """A communicator over ``ranks`` (global ranks, in group-rank order)."""

    def __init__(self, transport, ranks: list[int], name: str, timeout: float) -> None:
        self.t = transport
        self.ranks = ranks
        self.rank = transport.rank
        self.size = transport.world
        self.name = name
        self.role = ""  # what the group is for ("tp", "dp", ...: new_group(role=)); traces group by it
        self.timeout = timeout
        self.backend = transport.name
        self.engine = Engine(transport)
        if transport.abort_frames and self.size > 2:
            # Ranks that time out hear, in the last tenth of the timeout (1 s at most), whom their
            # peers wait for, so all of them name the rank really at fault (engine._agree_on_culprit).
            self.engine.agree_s = min(1.0, 0.1 * timeout)
        self.direct = None
        self.hier = None  # a helios.comm.hierarchical.Hierarchy when the group spans hosts (the world)
        if transport.name == "shm":
            from helios.comm.shm_direct import ShmDirect

            self.direct = ShmDirect(transport)
        self.seg_bytes = int(os.environ.get("HELIOS_COMM_SEGMENT_BYTES") or 1 << 20)
        self.debug = os.environ.get("HELIOS_COMM_DEBUG", "") not in ("", "0")
        self.seq = 0
        self._p2p_send = [0] * self.size
        self._p2p_recv = [0] * self.size
        self.broken: str | None = None
        self.op_deadline = 0.0  # of the operation running (or last run), time.monotonic()
        self._cv = threading.Condition()
        self._queue: deque[tuple[Callable[[], None], Work, bool, int]] = deque()
        self._running = False
        self._op_async, self._op_issued = False, 0  # of the operation running now (for the profiler)
        self._worker: threading.Thread | None = None
        self._closing = False
        self.counters = CommCounters()
        self._program_thread = 0  # ident of the thread running an enqueued program (0: none)

    # ---- ranks -------------------------------------------------------------------------
    def name_hosts(self, hosts: list[str]) -> None:
        """Where each member runs (``hosts[i]`` for group rank i, e.g. ``"node7 (10.0.0.7)"``): a
        failure blamed on a peer then names its host, and its global rank."""
        self.engine.peers = [(f"is on host {h}" if g == i else f"is global rank {g}, on host {h}")
                             for i, (g, h) in enumerate(zip(self.ranks, hosts))]

    def group_rank(self, global_rank: int, what: str = "rank") -> int:
        """Group rank of a global rank (ValueError when it is not a member)."""
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"helios.comm: {what} {global_rank} is not in group {self.name} {self.ranks}.") from None

    # ---- execution -----------------------------------------------------------------------
    def submit(self, name: str, fn: Callable[[], None], async_op: bool) -> Work | None:
        """Run ``fn`` in issue order; return a Work when ``async_op``."""
        issued = time.monotonic_ns() if current_collector() is not None else 0
        if self._program_thread == threading.get_ident():
            # Called from a program this communicator is running (enqueue): the program holds
            # the communicator, so the operation runs now, in the program's order.
            fn()
            if not async_op:
                return None
            done = Work(name)
            done._finish(None)
            return done
        with self._cv:
            self._check_usable()
            inline = not async_op and not self._queue and not self._running
            if inline:
                self._running = True
                self._op_async, self._op_issued = False, issued
            else:
                work = Work(name)
                self._queue.append((fn, work, async_op, issued))
                if self._worker is None:
                    self._worker = threading.Thread(target=self._work_loop, name=f"helios-comm-{self.name}", daemon=True)
                    self._worker.start()
                self._cv.notify_all()
        if inline:
            try:
                fn()
            finally:
                with self._cv:
                    self._running = False
                    self._cv.notify_all()
            return None
        if async_op:
            return work
        work.wait()
        return None

    def enqueue(self, name: str, program: Callable[[], None]) -> Work:
        """Run ``program()`` on the worker thread after every operation issued before it.

        Collectives the program calls on this communicator run at once, inside it, in the
        program's order (a comm hook's compress / all-reduce / decompress chain); every rank
        must enqueue the same programs in the same order, as for any collective.
        """

        def run() -> None:
            self._program_thread = threading.get_ident()
            try:
                program()
            except BaseException as e:
                # The peers may be waiting in the program's next collective: stop them now.
                self.poison(f"{name}: {type(e).__name__}: {str(e)[:300]}", frames=True)
                raise
            finally:
                self._program_thread = 0

        work = self.submit(name, run, True)
        assert work is not None
        return work

    def _work_loop(self) -> None:
        while True:
            with self._cv:
                while (not self._queue or self._running) and not self._closing:
                    self._cv.wait()
                if self._closing and not self._queue:
                    return
                fn, work, self._op_async, self._op_issued = self._queue.popleft()
                self._running = True
            try:
                fn()
                work._finish(None)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter, which re-raises it
                work._finish(e)
            finally:
                # Drop the operation (its closure holds the caller's buffers) now, not when the
                # next one replaces it: an idle worker must not keep a K/V block or a bucket alive.
                fn = work = None
                with self._cv:
                    self._running = False
                    self._cv.notify_all()

    def _check_usable(self) -> None:
        if self.broken is not None:
            raise CommError(
                f"helios.comm: group {self.name} is unusable after an earlier failure ({self.broken}). "
                "Call destroy_process_group() and init_process_group() to re-create it."
            )

    def run_op(self, name: str, nbytes: int, body: Callable[[A.Ctx], None], desc: str, p2p: bool = False,
               deadline: float | None = None) -> None:
        """Execute one operation with a fresh deadline, sequence number and error handling.

        ``deadline`` (a ``time.monotonic()`` value): when the operation is a step of a larger one
        (a level of a hierarchical collective), that one's; default: now + the group's timeout."""
        self._check_usable()
        col = current_collector()
        if col is None:
            self._run_op(name, nbytes, body, desc, p2p, deadline)
            return
        seq, t0, ok = self.seq, time.monotonic_ns(), False
        take_device_ready_ns()
        try:
            self._run_op(name, nbytes, body, desc, p2p, deadline)
            ok = True
        finally:
            t1 = time.monotonic_ns()
            # The transfer starts once the device has produced the operands (a gradient bucket
            # issued during backward waits for its kernels first): report that wait apart.
            ready = min(max(take_device_ready_ns(), t0), t1)
            col.record_comm(name, self.name, seq, nbytes, ready, t1, async_op=self._op_async,
                            issue_ns=min(self._op_issued or t0, t0), ok=ok, backend=self.backend, p2p=p2p,
                            device_wait_ns=ready - t0, role=self.role)
            self._op_async, self._op_issued = False, 0

    def _run_op(self, name: str, nbytes: int, body: Callable[[A.Ctx], None], desc: str, p2p: bool,
                deadline: float | None = None) -> None:
        seq = self.seq
        if not p2p:
            self.seq += 1
        info = OpInfo(name, seq, nbytes, self.name)
        self.engine.info = info
        if self.direct is not None:
            self.direct.info = info
        deadline = time.monotonic() + self.timeout if deadline is None else deadline
        self.op_deadline = deadline
        if self.direct is not None:
            self.direct.deadline = deadline
        self.engine.reset_scratch()
        ctx = A.Ctx(self.engine, self.rank, self.size, seq, self.seg_bytes, deadline)
        c = self.counters
        c.calls[name] = c.calls.get(name, 0) + 1
        c.payload_bytes[name] = c.payload_bytes.get(name, 0) + nbytes
        sent0 = self._sent()
        try:
            if self.debug and not p2p:
                self._debug_check(ctx, desc)
            body(ctx)
        except _Mismatch as e:
            raise CommError(str(e)) from None
        except BaseException as e:
            reason = str(e) if isinstance(e, CommError) else f"{type(e).__name__}: {e}"
            self.poison(f"{name} #{seq}: {reason[:300]}", self._fault_of(e, reason), frames=True)
            if isinstance(e, CommError):
                raise
            if isinstance(e, PeerLost):
                raise CommError(self.engine._describe(str(e), e.peer)) from None
            raise
        finally:
            c.bytes_sent += self._sent() - sent0

    def _sent(self) -> int:
        return self.engine.bytes_sent + (self.direct.bytes_sent if self.direct is not None else 0)

    def _fault_of(self, e: BaseException, reason: str) -> Fault:
        """Who is to blame for exception ``e`` of the running operation (told to the peers in the abort)."""
        me = self.rank
        if self.engine.fault is not None:
            return self.engine.fault
        tf = getattr(self.t, "fault", None)
        if isinstance(tf, Fault):
            return tf
        if isinstance(e, PeerLost):
            return Fault.of(e, me)
        m = re.search(r"timed out waiting for rank (\d+)", reason) if isinstance(e, CommError) else None
        if m and int(m.group(1)) != me:
            return Fault(int(m.group(1)), f"stopped responding (rank {me} timed out waiting for it)", me)
        return Fault(me, f"gave up after its own failure ({reason[:200]})", me)

    def poison(self, reason: str, fault: Fault | None = None, frames: bool = False) -> None:
        """Mark the communicator unusable and tell the peers (they stop waiting on us).

        ``fault`` (default: this rank's own failure) is what the peers are told about who
        is to blame.  ``frames``: also send abort frames over the links, which only the
        thread that ran the failed operation may do.
        """
        if self.broken is None:
            self.broken = reason
            if fault is None:
                fault = Fault(self.rank, f"gave up after its own failure ({reason[:200]})", self.rank)
            if self.hier is not None:  # the world across hosts: host-mates may wait on us in a level.
                self.hier.tell_host_mates(self, reason, fault)  # first: the frames below may take a while
            if frames and self.t.abort_frames:
                try:
                    self.engine.send_abort(fault)
                except Exception:  # noqa: BLE001, S110 - best effort: the peers see the links close instead
                    pass
            try:
                self.t.abort_fault(fault, reason)
            except Exception:  # noqa: BLE001, S110 - best effort: the peers still time out on their own
                pass
            self.engine.reset()

    # ---- debug checks --------------------------------------------------------------------
    def _debug_check(self, ctx: A.Ctx, desc: str) -> None:
        mine = np.frombuffer(desc.encode()[:_DESC].ljust(_DESC, b" "), dtype=np.uint8).copy()
        out = np.empty(_DESC * self.size, dtype=np.uint8)
        if self.direct is not None:
            self.direct.all_gather(out, mine)
        else:
            c2 = A.Ctx(ctx.e, ctx.rank, ctx.n, ctx.seq, 1 << 20, ctx.deadline)
            base = ctx.tag
            c2.tag = lambda step, seg=0: base(step + _DEBUG_STEP, seg)  # type: ignore[method-assign]
            A.ring_all_gather(c2, out, mine)
        descs = [bytes(out[i * _DESC:(i + 1) * _DESC]).decode(errors="replace").rstrip() for i in range(self.size)]
        if len(set(descs)) > 1:
            lines = "; ".join(f"rank {self.ranks[i]}: {d}" for i, d in enumerate(descs))
            raise _Mismatch(
                f"helios.comm: HELIOS_COMM_DEBUG: call #{ctx.seq} on group {self.name} differs between ranks "
                f"({lines}). Every rank must call the same collective with the same sizes, dtype, op and root; "
                "nothing was transferred and the communicator is still usable."
            )

    # ---- algorithm choice -------------------------------------------------------------
    def pick(self, op: str, nbytes: int, algorithm: str) -> str:
        """The algorithm to run: forced, or direct on shm, or the cost model's choice."""
        if algorithm not in ALGORITHMS:
            raise ValueError(f"helios.comm: algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}.")
        if algorithm == "hierarchical":  # flat here (the hierarchical form is chosen before, by the caller)
            algorithm = "auto"
        if algorithm != "auto":
            return algorithm
        if self.direct is not None:
            return "direct"
        return cost.choose(op, nbytes, self.size, self.backend, self.seg_bytes)

    # ---- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker and release the transport."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        w = self._worker
        if w is not None and w is not threading.current_thread():
            w.join(timeout=1.0)
            if w.is_alive():
                # An operation is still running (a peer is stuck): make it fail now, and
                # if it still runs, leave the mappings to process exit rather than unmap
                # memory under it.
                self.poison("the process group was destroyed while an operation was running")
                w.join(timeout=1.0)
                if w.is_alive():
                    return
        if self.direct is not None:
            self.direct.release()
        if self.hier is not None:
            self.hier.close()
            self.hier = None
        self.engine.reset()
        self.t.close()


class _Mismatch(Exception):
    pass
