/*
 * helios.comm._shm: the few primitives the shared-memory transport cannot get from Python.
 *
 * Flags live in shared memory mapped by every rank of a host.  A flag is a 64-bit
 * generation counter on its own cache line, followed by a 32-bit count of sleepers:
 *
 *   [ u64 value | u32 sleepers | padding to 64 bytes ]
 *
 * The owner publishes with a release store (data written before the store is visible to
 * whoever acquires the new value), then wakes sleepers through a futex on the low 32 bits
 * of the value only when some are registered, so a publish costs no system call when
 * every waiter is still spinning.  Waiters spin for a bounded time and then sleep on the
 * futex with a timeout, so a wait never outlives its deadline and Python can check peer
 * liveness between slices.  Addresses are passed as integers (numpy's .ctypes.data of the
 * mapping), and every wait releases the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() do { } while (0)
#endif

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t ld_acq(uintptr_t addr) {
    return __atomic_load_n((uint64_t *)addr, __ATOMIC_ACQUIRE);
}

/* futex on the low half of a little-endian 64-bit counter: the low half changes whenever
 * the counter moves (a wrap by exactly 2^32 between two looks is not reachable). */
static inline uint32_t *futex_word(uintptr_t addr) {
    return (uint32_t *)addr;
}

static void futex_wait_ns(uintptr_t addr, uint32_t seen, uint64_t ns) {
    struct timespec ts;
    ts.tv_sec = (time_t)(ns / 1000000000ull);
    ts.tv_nsec = (long)(ns % 1000000000ull);
    /* Not FUTEX_PRIVATE: the word is in a MAP_SHARED mapping used by other processes. */
    syscall(SYS_futex, futex_word(addr), FUTEX_WAIT, seen, &ts, NULL, 0);
}

static void wake_if_sleeping(uintptr_t addr) {
    /* The seq_cst fence pairs with the waiter's seq_cst increment of sleepers followed by
     * its re-read of the value: either it sees our value or we see its registration. */
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n((uint32_t *)(addr + 8), __ATOMIC_RELAXED) != 0)
        syscall(SYS_futex, futex_word(addr), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static PyObject *py_load(PyObject *self, PyObject *args) {
    unsigned long long addr;
    if (!PyArg_ParseTuple(args, "K", &addr)) return NULL;
    return PyLong_FromUnsignedLongLong(ld_acq((uintptr_t)addr));
}

static PyObject *py_store(PyObject *self, PyObject *args) {
    unsigned long long addr, val;
    if (!PyArg_ParseTuple(args, "KK", &addr, &val)) return NULL;
    __atomic_store_n((uint64_t *)(uintptr_t)addr, (uint64_t)val, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* publish(addr, value): release-store the value and wake sleepers of that flag. */
static PyObject *py_publish(PyObject *self, PyObject *args) {
    unsigned long long addr, val;
    if (!PyArg_ParseTuple(args, "KK", &addr, &val)) return NULL;
    __atomic_store_n((uint64_t *)(uintptr_t)addr, (uint64_t)val, __ATOMIC_RELEASE);
    wake_if_sleeping((uintptr_t)addr);
    Py_RETURN_NONE;
}

/* ring(addr): add one to a doorbell flag (several writers) and wake its sleepers. */
static PyObject *py_ring(PyObject *self, PyObject *args) {
    unsigned long long addr;
    if (!PyArg_ParseTuple(args, "K", &addr)) return NULL;
    __atomic_fetch_add((uint64_t *)(uintptr_t)addr, 1, __ATOMIC_SEQ_CST);
    wake_if_sleeping((uintptr_t)addr);
    Py_RETURN_NONE;
}

/* One step of the spin phase: pause, and every few steps yield the core, so a peer that
 * the scheduler put on this same core runs now instead of after our spin budget. */
static inline void spin_pause(unsigned *spins) {
    for (int k = 0; k < 64; k++) CPU_RELAX();
    if ((++*spins & 7u) == 0) sched_yield();
}

/* Sleep on flag `addr` while its value equals `seen`, at most `ns`. */
static void sleep_on(uintptr_t addr, uint64_t seen, uint64_t ns) {
    uint32_t *sleepers = (uint32_t *)(addr + 8);
    __atomic_fetch_add(sleepers, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n((uint64_t *)addr, __ATOMIC_SEQ_CST) == seen)
        futex_wait_ns(addr, (uint32_t)seen, ns);
    __atomic_fetch_sub(sleepers, 1, __ATOMIC_SEQ_CST);
}

/*
 * wait_all_ge(addrs, target, doorbell, spin_ns, timeout_ns) -> index or -1
 *
 * addrs: bytes of packed u64 flag addresses.  Returns -1 once every flag >= target, else
 * (after timeout_ns) the index of the first flag still below target.  Sleeps on the
 * caller's own doorbell flag, which every publisher rings after moving its flag.
 */
static PyObject *py_wait_all_ge(PyObject *self, PyObject *args) {
    Py_buffer addrs;
    unsigned long long target, doorbell, spin_ns, timeout_ns;
    if (!PyArg_ParseTuple(args, "y*KKKK", &addrs, &target, &doorbell, &spin_ns, &timeout_ns)) return NULL;
    const uint64_t *a = (const uint64_t *)addrs.buf;
    Py_ssize_t n = addrs.len / 8;
    Py_ssize_t lag = -1;
    Py_BEGIN_ALLOW_THREADS
    uint64_t start = now_ns(), spin_end = start + spin_ns, end = start + timeout_ns;
    unsigned spins = 0;
    Py_ssize_t i = 0;
    for (;;) {
        uint64_t bell = __atomic_load_n((uint64_t *)(uintptr_t)doorbell, __ATOMIC_SEQ_CST);
        while (i < n && ld_acq((uintptr_t)a[i]) >= target) i++;
        if (i == n) { lag = -1; break; }
        uint64_t t = now_ns();
        if (t >= end) { lag = i; break; }
        if (t < spin_end) {
            spin_pause(&spins);
            continue;
        }
        uint64_t left = end - t;
        sleep_on((uintptr_t)doorbell, bell, left < 20000000ull ? left : 20000000ull);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&addrs);
    return PyLong_FromSsize_t(lag);
}

/* wait_change(addr, seen, spin_ns, timeout_ns) -> current value (== seen on timeout). */
static PyObject *py_wait_change(PyObject *self, PyObject *args) {
    unsigned long long addr, seen, spin_ns, timeout_ns;
    if (!PyArg_ParseTuple(args, "KKKK", &addr, &seen, &spin_ns, &timeout_ns)) return NULL;
    uint64_t v;
    Py_BEGIN_ALLOW_THREADS
    uint64_t start = now_ns(), spin_end = start + spin_ns, end = start + timeout_ns;
    unsigned spins = 0;
    for (;;) {
        v = ld_acq((uintptr_t)addr);
        if (v != seen) break;
        uint64_t t = now_ns();
        if (t >= end) break;
        if (t < spin_end) {
            spin_pause(&spins);
            continue;
        }
        uint64_t left = end - t;
        sleep_on((uintptr_t)addr, seen, left < 20000000ull ? left : 20000000ull);
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(v);
}

static PyMethodDef methods[] = {
    {"load", py_load, METH_VARARGS, "load(addr) -> acquire load of the u64 at addr."},
    {"store", py_store, METH_VARARGS, "store(addr, value): release store of a u64."},
    {"publish", py_publish, METH_VARARGS, "publish(addr, value): release store, then wake sleepers of that flag."},
    {"ring", py_ring, METH_VARARGS, "ring(addr): atomic +1 on a doorbell flag, then wake its sleepers."},
    {"wait_all_ge", py_wait_all_ge, METH_VARARGS,
     "wait_all_ge(addrs, target, doorbell, spin_ns, timeout_ns) -> -1 when all flags >= target, else the index of a laggard."},
    {"wait_change", py_wait_change, METH_VARARGS,
     "wait_change(addr, seen, spin_ns, timeout_ns) -> value; returns when the flag differs from seen or at timeout."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_shm", "Atomics and futex waits for helios.comm's shared-memory transport.", -1, methods,
};

PyMODINIT_FUNC PyInit__shm(void) { return PyModule_Create(&moduledef); }
