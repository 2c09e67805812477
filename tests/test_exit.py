"""A job that finishes exits 0, whatever state its Checkpointer is in when main returns.

Each case runs tests/_exit_job.py under torchrun on 2 gloo ranks (the quickstart's model, residual 4-bit deltas,
a compaction every 2 deltas, memory images on) and ends it in one state: ``close()`` called or not, the process
group destroyed or kept, and a save's write, its memory-image update or a background compaction stalled on rank 1
(``CNR_FAULT=...:pause=MS``) so that it is still under way when main returns. Each job ends, as jobs do, with a
few collectives. The process must exit 0 with no ``terminate called`` (a gloo worker thread that asks for the GIL
once the interpreter is finalizing aborts the process: cnr_torchrec/_exit.py), and what it left on storage must
verify, its newest checkpoint the last save (or the compaction that was under way).
"""

from __future__ import annotations

import os

import pytest
from _torchrun import torchrun

from cnr_torchrec.ckpt.format.commits import committed_ids
from cnr_torchrec.ckpt.tools.root import open_storage
from cnr_torchrec.ckpt.tools.verify import verify_root

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_exit_job.py")
TIMEOUT_S = 200

pytestmark = pytest.mark.multirank

# state: the CNR_FAULT that holds its step under way as main returns (none: the state needs no stall)
CASES = {
    "closed": "",
    "unclosed": "",
    "unclosed-group-kept": "",
    "closed-group-kept": "",
    "save-writing": "write.after:rank=1:nth=4:pause=1500",
    "image-updating": "image.mid:rank=1:nth=4:pause=1500",
    "compaction-starting": "",
    "compaction-running": "compact.after_write:rank=1:pause=1500",
    "compaction-closed": "compact.after_write:rank=1:pause=1500",
}
# In `make test`: the states of the two bugs found (the gloo worker at exit; a background save or compaction
# that Python's pools refuse at exit) and an image update; every state runs in `make reliability`.
QUICK = ("closed", "save-writing", "image-updating", "compaction-running")


def _run(tmp_path, state: str, fault: str) -> str:
    args = ["--root", str(tmp_path / "root"), "--images", str(tmp_path / "images"), "--state", state]
    rc, log = torchrun(JOB, args, cwd=tmp_path, env={"CNR_FAULT": fault}, timeout_s=TIMEOUT_S,
                       name=f"{state} (an exit that hangs?)")
    assert "terminate called" not in log, f"{state}: a C++ thread aborted the exit:\n{log[-4000:]}"
    assert rc == 0, f"{state}: torchrun exited {rc}:\n{log[-4000:]}"
    return log


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("state", [s if s in QUICK else pytest.param(s, marks=pytest.mark.long) for s in sorted(CASES)])
def test_a_job_exits_0_and_leaves_a_sound_root(tmp_path, state):
    fault = CASES[state]
    log = _run(tmp_path, state, fault)
    assert "last save 4" in log, log[-2000:]
    if fault:
        assert "stalls for 1500 ms" in log, f"{state}: the fault never fired, so the state was not reached"
    root = str(tmp_path / "root")
    assert verify_root(root) == []
    storage = open_storage(root)
    try:
        ids = committed_ids(storage)
    finally:
        storage.close()
    # The last save (4) and the compaction it started (3) committed, even where their work outlived main.
    assert max(ids) == 4 and 3 in ids, ids


def test_a_checkpointer_that_fails_to_open_leaves_nothing_for_the_exit(group, tmp_path, monkeypatch, caplog):
    """A constructor that raises (here: the root's listing) closes what it opened and is not tracked, so the exit
    does not wait on it or log a failure of a half-built object."""
    import gc

    from _toy import build_dmp

    from cnr_torchrec import Checkpointer, _exit, load_config
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.errors import StorageError
    from examples.toy import TableSpec

    dmp, opt = build_dmp([TableSpec("t0", 32, 8, "row_wise")], seed=0)
    closed = []
    real_close = Storage.close
    monkeypatch.setattr(Storage, "close", lambda self: (closed.append(self.root), real_close(self))[1])

    def refuse(self, origin):
        raise OSError("the listing failed")

    monkeypatch.setattr(Checkpointer, "_open_root", refuse)
    with pytest.raises(StorageError, match="the listing failed"):
        Checkpointer(dmp, load_config({"root": str(tmp_path / "root"), "memory_tier": "off"}), dense_optimizer=opt)
    gc.collect()
    assert closed, "the storage it opened was left open"
    with caplog.at_level("WARNING", logger="cnr_torchrec._exit"):
        _exit.finish_background_work()
    assert "at exit" not in caplog.text
