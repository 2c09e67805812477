"""A clean interpreter exit: the background work finishes while its thread pools run, and torch's collective
threads settle while Python can still serve them.

Two things went wrong when a job's main returned with work under way.

**Background saves and compactions failed at exit.** Python stops ``concurrent.futures`` pools at shutdown: its
own hook (``threading._register_atexit``) marks them shut, and a thread that submits work to any pool after that
gets ``RuntimeError: cannot schedule new futures after interpreter shutdown``. A save or a compaction still
running when main returned submits its chunk reads and writes to the Checkpointer's I/O threads (and the storage
plugins to their own), so it failed and could not even remove its partial files. :func:`track` puts a
``Checkpointer`` on a list that a hook of ours, registered the same way and later (so it runs first), waits for:
each one's save in flight and its part of a background compaction (``Checkpointer.wait(compaction=True)``).

**A finished job could die at exit with** ``terminate called without an active exception`` (SIGABRT, exit
-6). A ``ProcessGroupGloo`` outlives ``destroy_process_group()`` whenever something still references it (the
model does: ``DistributedModelParallel``, DDP and every sharded module hold their group), and so do its worker
threads (``pt_gloo_runloop``), which ``shutdown()`` does not join. A worker that has just finished a collective
drops the work's tensors; a tensor whose Python object is gone by then (a temporary of ``all_gather_object``, an
eval loss) hands its ``PyObject`` back, which needs the GIL. Once the interpreter is finalizing, CPython 3.11
answers a thread that asks for the GIL with ``pthread_exit``, whose forced unwind meets a ``noexcept``
destructor on the worker's stack, and libstdc++ calls ``std::terminate`` (``ProcessGroupGloo::runLoop`` ->
``TensorImpl::decref_pyobject`` -> ``PyEval_AcquireThread`` -> ``pthread_exit``). :func:`register` installs an
``atexit`` handler, which runs after Python has joined its threads and before finalization: it sleeps in short
slices (the GIL released) until every gloo worker thread is asleep and has not run for two slices in a row, at
most :data:`LIMIT_S`; about 16 to 20 ms at the end of a 2-rank job here. docs/reliability.md has the figures.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from typing import Any

__all__ = ["register", "settle_collective_threads", "track"]

log = logging.getLogger(__name__)

WORKER_NAMES = ("pt_gloo_runloop",)  # the names torch gives ProcessGroupGloo's worker threads
SLICE_S = 0.005
LIMIT_S = 2.0

_registered = False
_lock = threading.Lock()
_background: weakref.WeakSet[Any] = weakref.WeakSet()  # the live Checkpointers, whose work must finish first


def register() -> None:
    """Installs both exit hooks once per process (idempotent, thread-safe)."""
    global _registered
    with _lock:
        if _registered:
            return
        # Python's own pools stop in a hook of this kind, registered when concurrent.futures.thread was
        # imported; these hooks run last registered first, so ours runs while the pools still take work.
        before_pools = getattr(threading, "_register_atexit", None)
        if before_pools is not None:
            before_pools(finish_background_work)
        else:  # not CPython 3.9+: at least the work is awaited (its I/O may then fail, the last commit kept)
            atexit.register(finish_background_work)
        atexit.register(settle_collective_threads)
        _registered = True


def track(checkpointer: Any) -> None:
    """Has the exit wait for ``checkpointer``'s background work (anything with ``wait(compaction=True)``)."""
    register()
    _background.add(checkpointer)


def finish_background_work() -> None:
    """Waits for each tracked Checkpointer's save in flight and its part of a background compaction. A failure is
    logged, not raised: the previous checkpoint is intact, as after any failed save."""
    for checkpointer in list(_background):
        try:
            checkpointer.wait(compaction=True)
        except Exception as e:  # noqa: BLE001 - an exit must go on; the save's own error names the cause
            log.warning("at exit: the background save or compaction failed: %s: %s", type(e).__name__, e)


def _workers() -> list[str]:
    """The thread ids of this process's gloo workers (Linux's /proc; none elsewhere)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    out = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() in WORKER_NAMES:
                    out.append(tid)
        except OSError:  # the thread ended meanwhile
            continue
    return out


def _activity(tid: str) -> tuple[str, int] | None:
    """A worker's scheduler state and its context switches so far; None once it has ended."""
    try:
        with open(f"/proc/self/task/{tid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    switches = sum(int(fields.get(k, "0")) for k in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"))
    return fields.get("State", "").strip()[:1], switches


def settle_collective_threads(limit_s: float = LIMIT_S) -> float:
    """Sleeps (the GIL released) until every gloo worker thread sleeps and has not run for two slices in a
    row, or ``limit_s`` passes. Returns the seconds it waited (0 with no worker thread)."""
    tids = _workers()
    if not tids:
        return 0.0
    start = time.monotonic()
    previous: list[tuple[str, int] | None] | None = None
    quiet = 0
    while time.monotonic() - start < limit_s:
        time.sleep(SLICE_S)  # a worker that waits for the GIL to drop a tensor takes it now
        now = [_activity(t) for t in tids]
        asleep = all(a is None or a[0] == "S" for a in now)
        quiet = quiet + 1 if asleep and now == previous else 0
        if quiet >= 2:
            break
        previous = now
    return time.monotonic() - start
