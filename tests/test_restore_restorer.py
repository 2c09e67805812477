"""Which checkpoint a restore takes, and what it does when it cannot (``cnr_torchrec/ckpt/restore/restorer.py``).

``Restorer`` is the collective part of ``Checkpointer.restore``: rank 0 picks a chain, every rank applies it,
all agree, and a failure falls back (``on_corrupt: fallback``) or is refused by name. It is driven here through
``Checkpointer.restore``, its one caller, on chains the real ``Checkpointer`` wrote for the toy model; the
references are the saving model's state (shards, optimizer state, dense parameters, a reader position) as it
stood at each save, bit for bit, and the checkpoints' own files, which the tests damage.

Restores are exercised elsewhere too: each rank's failure heard alike (``test_rank_errors.py``), a failure part
way rolled back (``test_restore_outcomes.py``), crafted manifests and structures (``test_manifest_schema.py``,
``test_crafted_structure.py``, ``test_integrity.py``), branches (``test_retention_branches.py``), memory images
(``test_memory_tier.py``) and every policy and codec (``test_checkpointer_multirank.py``).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from _dist import run_ranks
from _toy import Reader, build_dmp, local_state, train

from cnr_torchrec.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    RestoreFailedError,
)


def _specs():
    from examples.toy import TableSpec

    return [TableSpec("t0", 64, 8, "row_wise"), TableSpec("t1", 32, 4, "table_wise")]


def _config(root: str, **kw):
    from cnr_torchrec import load_config

    return load_config({"root": root, "policy": "consecutive", "keep_last": 10,
                        "quantization": {"method": "none", "residual": False}, **kw})


def _state(dmp, reader) -> dict:
    out = local_state(dmp)
    out["reader"] = reader.pos.clone()
    return out


def _differ(got: dict, want: dict) -> list:
    assert got.keys() == want.keys()
    return [k for k in want if not torch.equal(got[k], want[k])]


def _write(root: str, saves: int = 4) -> list[dict]:
    """Checkpoints of steps 1..saves, each a delta on the one before. Returns the state at each save."""
    from cnr_torchrec import Checkpointer

    specs = _specs()
    dmp, opt = build_dmp(specs)
    reader = Reader()
    gen = torch.Generator().manual_seed(0)
    states = []
    with Checkpointer(dmp, _config(root), dense_optimizer=opt, extra_state={"reader": reader}) as ck:
        for step in range(1, saves + 1):
            train(dmp, specs, opt, 2, gen)
            reader.pos.fill_(step)
            ck.save(step).wait()
            states.append(_state(dmp, reader))
    return states


@pytest.fixture(scope="module")
def saved(group, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("saved") / "root")
    return root, _write(root)


def _copy(root: str, tmp_path, name: str = "copy") -> str:
    return str(shutil.copytree(root, tmp_path / name))


def _damage(root: str, ckpt: int) -> str:
    """Flips a byte in every 256 of checkpoint ``ckpt``'s rank file (same size: only its checksums tell).
    Returns the file's path under the root."""
    rel = os.path.join(f"ckpt-{ckpt:08d}", "rank-00000.bin")
    with open(os.path.join(root, rel), "r+b") as f:
        data = bytearray(f.read())
        for at in range(128, len(data), 256):
            data[at] ^= 0xFF
        f.seek(0)
        f.write(data)
    return rel


def _restorer(root: str, **kw):
    from cnr_torchrec import Checkpointer

    dmp, opt = build_dmp(_specs(), seed=7)
    reader = Reader()
    return Checkpointer(dmp, _config(root, **kw), dense_optimizer=opt, extra_state={"reader": reader}), dmp, reader


def test_a_restore_takes_the_newest_checkpoint_or_the_newest_of_a_step(saved):
    root, states = saved
    ck, dmp, reader = _restorer(root)
    with ck:
        assert ck.restore() == 4
        assert _differ(_state(dmp, reader), states[3]) == []
        assert ck.restore(step=2) == 2
        assert _differ(_state(dmp, reader), states[1]) == []
        with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint of step 9"):
            ck.restore(step=9)
        assert _differ(_state(dmp, reader), states[1]) == []  # a refused restore changes nothing


def test_an_empty_root_is_not_found_and_changes_nothing(group, tmp_path):
    ck, dmp, reader = _restorer(str(tmp_path / "empty"))
    before = _state(dmp, reader)
    with ck, pytest.raises(CheckpointNotFoundError, match="no complete checkpoint under"):
        ck.restore()
    assert _differ(_state(dmp, reader), before) == []


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(saved, tmp_path):
    root, states = saved
    root = _copy(root, tmp_path)
    _damage(root, 3)  # the tip (ids count from 0)
    ck, dmp, reader = _restorer(root, on_corrupt="fallback")
    with ck:
        assert ck.restore() == 3
    assert _differ(_state(dmp, reader), states[2]) == []


def test_a_damaged_file_under_on_corrupt_fail_is_named_and_the_model_kept(saved, tmp_path):
    root, _ = saved
    root = _copy(root, tmp_path)
    rel = _damage(root, 3)
    ck, dmp, reader = _restorer(root, on_corrupt="fail")
    before = _state(dmp, reader)
    with ck, pytest.raises(CorruptCheckpointError, match="on_corrupt: fail") as e:
        ck.restore()
    assert e.value.path is not None and e.value.path.endswith(rel), e.value.path
    assert _differ(_state(dmp, reader), before) == []


def test_a_root_where_no_checkpoint_restores_is_a_failed_restore_not_a_fresh_start(saved, tmp_path):
    root, _ = saved
    root = _copy(root, tmp_path)
    rel = _damage(root, 0)  # the baseline: every chain of the root holds it
    ck, dmp, reader = _restorer(root, on_corrupt="fallback")
    before = _state(dmp, reader)
    with ck, pytest.raises(RestoreFailedError, match="none could be restored") as e:
        ck.restore()
    assert not isinstance(e.value, CheckpointNotFoundError)
    # The culprit, named by its file; the chains through it (checkpoints 1 to 3) are passed over for it.
    assert list(e.value.skipped) == [0] and rel in e.value.skipped[0], e.value.skipped
    assert _differ(_state(dmp, reader), before) == []  # restore_rollback: put back as it was


def _two_rank_writer(rank, world_size, root):
    _write(root, saves=2)


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_per_rank_state_of_another_world_size_is_refused_unless_dropped(group, tmp_path):
    root = str(tmp_path / "root")
    run_ranks(_two_rank_writer, world_size=2, timeout=150, args=(root,))
    ck, dmp, reader = _restorer(root)
    before = _state(dmp, reader)
    with ck:
        with pytest.raises(IncompatibleCheckpointError, match=r"written by 2 ranks and is restored onto 1: per-rank "
                                                             r"state \['reader'\]"):
            ck.restore()
        assert _differ(_state(dmp, reader), before) == []
        assert ck.restore(per_rank_state="drop") == 2
    after = _state(dmp, reader)
    assert torch.equal(after["reader"], before["reader"])  # left as it was
    assert not torch.equal(after[("t0", 0, "w")], before[("t0", 0, "w")])  # the rows were restored
