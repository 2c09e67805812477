"""Errors that reach every rank: storage that fails on one rank alone, on 2 gloo ranks.

Each test breaks the storage of one rank only (rank 0, where the code runs alone: the
listing and the choice of chain of a restore or a partial recovery, the commit marker of
a save, the copy of the replicated state) and checks what a user sees: every rank raises
the same named error, with the same message naming the rank and the original error, well
within the timeout, and the ranks are still in step afterwards (the same call succeeds
once the storage answers again, and a failed save leaves the previous checkpoint as it was).
"""

from __future__ import annotations

import contextlib
import errno
import time

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from _toy import build_dmp, local_state, train

pytestmark = pytest.mark.multirank

# Quick enough that a hang (a rank waiting in a collective for a rank that raised) fails the test.
WITHIN_S = 60


def _build(seed=0):
    from examples.toy import TableSpec

    specs = [TableSpec("t0", 64, 8, "row_wise"), TableSpec("t1", 64, 8, "table_wise"),
             TableSpec("t2", 64, 8, "data_parallel")]
    dmp, opt = build_dmp(specs, seed=seed)
    return dmp, specs, opt


def _checkpointer(dmp, opt, root):
    from cnr_torchrec import Checkpointer, load_config

    config = load_config({"root": root, "policy": "consecutive", "quantization": {"method": "none"}})
    return Checkpointer(dmp, config, dense_optimizer=opt)


def _client_error(code: str, operation: str) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": f"{code} (injected)"}}, operation)


@contextlib.contextmanager
def _broken(rank: int, on_rank: int, cls: type, method: str, error: Exception, paths: str = ""):
    """Makes ``cls.method`` raise ``error`` on rank ``on_rank`` alone, for paths ending in ``paths``.

    ``cls`` is :class:`~cnr_torchrec.ckpt.format.bytes.storage.Storage` (every Storage of that rank's
    process, the save thread's included) or a storage plugin class.
    """
    if rank != on_rank:
        yield
        return
    real = getattr(cls, method)

    def broken(self, *args, **kwargs):
        where = args[0] if args else ""
        where = getattr(where, "path", where)  # a plugin's ReadIO / WriteIO
        if str(where).endswith(paths):
            raise error
        return real(self, *args, **kwargs)

    setattr(cls, method, broken)
    try:
        yield
    finally:
        setattr(cls, method, real)


def _raises_alike(call, cls, *needles: str) -> BaseException:
    """Runs ``call`` on every rank: each raises exactly ``cls``, soon, with one message that names every needle."""
    t0 = time.monotonic()
    with pytest.raises(cls) as info:
        call()
    elapsed = time.monotonic() - t0
    err = info.value
    assert type(err) is cls, (type(err), err)
    assert elapsed < WITHIN_S, elapsed
    for needle in needles:
        assert needle in str(err), (needle, str(err))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (type(err).__name__, str(err)))
    assert all(e == everyone[0] for e in everyone), everyone
    return err


def _assert_state(dmp, want, keys=None) -> None:
    got = local_state(dmp)
    for key in want if keys is None else keys:
        assert torch.equal(got[key], want[key]), key


def _saved_then_moved_on(rank, root):
    """A model checkpointed at step 1 that then trained on: (dmp, optimizer, checkpointer, state at step 1)."""
    dmp, specs, opt = _build()
    ck = _checkpointer(dmp, opt, root)
    gen = torch.Generator().manual_seed(rank)
    train(dmp, specs, opt, 2, gen)
    ck.save(1).wait()
    saved = local_state(dmp)
    train(dmp, specs, opt, 2, gen)  # the model moves on; a restore must bring back step 1
    return dmp, opt, ck, saved


# ---- restore ------------------------------------------------------------------------


def _restore_worker(rank, world_size, root, case):
    from cnr_torchrec.ckpt.format.bytes.plugins import FSPlugin
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.errors import StorageError

    dmp, opt, ck, saved = _saved_then_moved_on(rank, root)

    if case == "listing":
        fault = _broken(rank, 0, Storage, "list_dirs", _client_error("AccessDenied", "ListObjectsV2"))
        needles = ("rank 0, choosing the checkpoint to restore", "ClientError", "AccessDenied", "ListObjectsV2")
    elif case == "manifest":
        fault = _broken(rank, 0, FSPlugin, "read", OSError(errno.EIO, "Input/output error"), "manifest.json")
        needles = ("rank 0, choosing the checkpoint to restore", "OSError", "Input/output error")
    else:  # every rank reads its own payload: a failure on rank 1 reaches rank 0 the same way
        fault = _broken(rank, 1, Storage, "read_mapped", _client_error("SlowDown", "GetObject"), ".bin")
        needles = ("rank 1, restoring checkpoint 0", "ClientError", "SlowDown", "GetObject")
    with fault:
        err = _raises_alike(ck.restore, StorageError, *needles, "try again")
        if case == "listing":
            # A Checkpointer opened while rank 0 cannot list the root: the same error, from the constructor.
            _raises_alike(lambda: _checkpointer(dmp, opt, root), StorageError, "rank 0, listing the checkpoints",
                          "AccessDenied")
    assert isinstance(err, OSError)  # StorageError is an OSError too
    origin = 1 if case == "payload" else 0
    assert (err.__cause__ is not None) == (rank == origin)  # the rank it happened on keeps the original

    # The ranks are still in step: once the storage answers, the same restore succeeds and is exact.
    assert ck.restore() == 1
    _assert_state(dmp, saved)
    ck.close()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", ["listing", "manifest", "payload"])
def test_restore_storage_failing_on_one_rank_raises_on_every_rank(tmp_path, case):
    run_ranks(_restore_worker, world_size=2, timeout=120, args=(str(tmp_path), case))


# ---- save ---------------------------------------------------------------------------


def _save_worker(rank, world_size, root):
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import existing_dir_ids
    from cnr_torchrec.errors import SaveFailedError

    dmp, specs, opt = _build()
    ck = _checkpointer(dmp, opt, root)
    gen = torch.Generator().manual_seed(rank)
    train(dmp, specs, opt, 2, gen)
    first = ck.save(1).wait()
    saved = local_state(dmp)

    # Rank 0's commit marker cannot be written: a full disk.
    train(dmp, specs, opt, 2, gen)
    full = OSError(errno.ENOSPC, "No space left on device")
    with _broken(rank, 0, Storage, "write_atomic", full, "manifest.json"):
        handle = ck.save(2)
        _raises_alike(handle.wait, SaveFailedError, "rank 0 could not commit", "OSError", "No space left on device",
                      "previous checkpoint is intact")

    # Rank 0 alone copies the replicated state (dense optimizer): that copy fails.
    train(dmp, specs, opt, 1, gen)
    def no_memory():
        raise RuntimeError("pinned host memory exhausted")

    if rank == 0:
        opt.state_dict = no_memory
    handle = ck.save(3)  # returns: the failure is the commit protocol's to report, on every rank
    _raises_alike(handle.wait, SaveFailedError, "rank 0: could not copy its state to host memory", "RuntimeError",
                  "pinned host memory exhausted")
    if rank == 0:
        del opt.state_dict

    # Nothing of the failed saves is left, and the last good checkpoint restores exactly.
    assert [i.id for i in ck.list()] == [first.id]
    assert existing_dir_ids(Storage(root)) == [first.id]
    fresh, _, opt2 = _build(seed=1)
    restorer = _checkpointer(fresh, opt2, root)
    assert restorer.restore() == 1
    _assert_state(fresh, saved)
    restorer.close()

    # And the job goes on: the next save commits, as a baseline (the failed ones lost their rows' history).
    assert ck.save(4).wait().kind == "baseline"
    ck.close()


@pytest.mark.timeout(150)
def test_failed_rank0_commit_fails_the_save_on_every_rank_and_keeps_the_previous_checkpoint(tmp_path):
    run_ranks(_save_worker, world_size=2, timeout=120, args=(str(tmp_path),))


# ---- partial recovery ---------------------------------------------------------------


def _recover_worker(rank, world_size, root):
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.errors import StorageError

    dmp, opt, ck, at_checkpoint = _saved_then_moved_on(rank, root)
    live = local_state(dmp)

    with _broken(rank, 0, Storage, "list_dirs", _client_error("ServiceUnavailable", "ListObjectsV2")):
        _raises_alike(lambda: ck.recover([1]), StorageError, "rank 0, choosing the checkpoint to restore",
                      "ServiceUnavailable", "try again")
    _assert_state(dmp, live)  # nothing was read or broadcast: every rank keeps its live state

    info = ck.recover([1])
    assert (info.step, info.failed_ranks) == (1, (1,))
    sharded = [k for k in live if isinstance(k, tuple) and not dmp.dirty_tracker.is_data_parallel(k[0])]
    _assert_state(dmp, at_checkpoint if rank == 1 else live, sharded)
    ck.close()


@pytest.mark.timeout(150)
def test_recover_whose_rank0_resolve_fails_raises_on_every_rank(tmp_path):
    run_ranks(_recover_worker, world_size=2, timeout=120, args=(str(tmp_path),))
