"""The chain's one rule (format/precedence.py), broken once, shows in every reader.

Every reader of a chain (the restore, ``cnr export``, the lossless merge and the fold of ``cnr
compact``) claims rows through ``Coverage.claim``. The toy model (a row-wise and a table-wise
table, TorchRec's EXACT_ROWWISE_ADAGRAD) writes two chains with the real Checkpointer:

- float32 rows (``method: none``): the restore, the export and the merged baseline each give the live
  weights at the last save, to the bit;
- residual 4-bit rows: the restore, the export and the folded baseline give the same bits.

Then the rule is broken, as a bug in it would be, and each reader's result is seen to change:
an older copy winning (no copy closes a row), residuals overwriting instead of adding
(every copy closes), and a residual entry's row modes ignored (its rows stored whole add onto
older copies instead of closing them).
"""

from __future__ import annotations

import pytest
import torch
from _toy import build_dmp, train

from cnr_torchrec.ckpt.format.precedence import Coverage

_TRUE_CLAIM = Coverage.claim  # the rule as written, which the broken ones below call


def _specs():
    from examples.toy import TableSpec

    return [TableSpec("t0", 64, 8, "row_wise"), TableSpec("t1", 32, 4, "table_wise")]


def _weights(dmp):
    tracker = dmp.dirty_tracker
    return {t: k.tbe.split_embedding_weights()[s.local_index].detach().clone()
            for t in tracker.tables() for k, s in tracker.shards(t)}


def _write(root, quantization, saves=4):
    """A baseline and deltas of a trained toy model. Returns the live weights at the last save, by table."""
    from cnr_torchrec import Checkpointer, load_config

    specs = _specs()
    dmp, opt = build_dmp(specs)
    gen = torch.Generator().manual_seed(0)
    config = load_config({"root": root, "keep_last": 10, "quantization": quantization})
    with Checkpointer(dmp, config, dense_optimizer=opt) as ck:
        for step in range(1, saves + 1):
            train(dmp, specs, opt, 2, gen)
            ck.save(step).wait()
    return _weights(dmp)


def _readers(root, quantization):
    """What each of the library's readers gives for ``root``'s newest checkpoint, by table: the restore, the
    export, and the restore of what ``cnr compact`` wrote. A reader that raises gives its error instead."""
    from cnr_torchrec import Checkpointer, load_config
    from cnr_torchrec.ckpt.compact.offline import compact
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.tools.export import export_state_dict
    from cnr_torchrec.errors import CnrError

    config = load_config({"root": root, "keep_last": 10, "quantization": quantization})

    def restored(step=None):
        dmp, opt = build_dmp(_specs(), seed=7)
        with Checkpointer(dmp, config, dense_optimizer=opt) as ck:
            ck.restore(step=step)
        return _weights(dmp)

    def on_storage(use):
        storage = Storage(root)
        try:
            return use(storage)
        finally:
            storage.close()

    def exported():
        state = on_storage(export_state_dict)
        return {t: state[next(k for k in state if k.endswith(f".{t}.weight"))] for t in ("t0", "t1")}

    def compacted():
        return restored(on_storage(compact).step)

    out = []
    for reader in (restored, exported, compacted):
        try:
            out.append(reader())
        except CnrError as e:
            out.append(e)
    return out


def _equal(a, b):
    """Whether two readers' results are the same bits (an error is equal to nothing)."""
    if isinstance(a, Exception) or isinstance(b, Exception):
        return False
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


PLAIN = {"method": "none", "residual": False}
RESIDUAL = {"method": "adaptive", "bits": 4, "residual": True}


def _older_copy_wins(self, seg, offsets, count, lo, hi, shift, *, closes):
    return _TRUE_CLAIM(self, seg, offsets, count, lo, hi, shift, closes=False)


def _residuals_overwrite(self, seg, offsets, count, lo, hi, shift, *, closes):
    return _TRUE_CLAIM(self, seg, offsets, count, lo, hi, shift, closes=True)


def _modes_ignored(self, seg, offsets, count, lo, hi, shift, *, closes):
    return _TRUE_CLAIM(self, seg, offsets, count, lo, hi, shift, closes=closes if isinstance(closes, bool) else False)


def _whole_rows(root):
    """The rows the residual entries of ``root``'s checkpoints store whole, and the rows they store."""
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import committed_ids, load_manifest

    storage = Storage(root)
    try:
        entries = [e for i in committed_ids(storage) for _, _, e in load_manifest(storage, i).entries() if e.residual]
    finally:
        storage.close()
    return sum(e.whole.count for e in entries if e.whole is not None), sum(e.num_stored for e in entries)


def _fresh(root, tmp_path, name):
    """A copy of ``root`` (``cnr compact`` adds a checkpoint to the root it compacts)."""
    import shutil

    return shutil.copytree(root, tmp_path / name)


def test_every_reader_follows_the_rule_and_a_broken_rule_shows_in_each(group, tmp_path, monkeypatch):
    plain, residual = tmp_path / "plain", tmp_path / "residual"
    live = _write(str(plain), PLAIN)
    _write(str(residual), RESIDUAL)

    restored, exported, merged = _readers(str(_fresh(plain, tmp_path, "p1")), PLAIN)
    assert _equal(restored, live) and _equal(exported, live) and _equal(merged, live)
    r_restored, r_exported, folded = _readers(str(_fresh(residual, tmp_path, "r1")), RESIDUAL)
    assert _equal(r_restored, r_exported) and _equal(r_restored, folded)
    assert not _equal(r_restored, live)  # 4-bit rows: the readers agree with each other, not with the live rows

    # An older copy winning: the plain chain's readers give stale rows, or find the chain incomplete.
    monkeypatch.setattr(Coverage, "claim", _older_copy_wins)
    for broken in _readers(str(_fresh(plain, tmp_path, "p2")), PLAIN):
        assert not _equal(broken, live)

    # Residuals overwriting instead of adding: the residual chain's readers give other sums.
    monkeypatch.setattr(Coverage, "claim", _residuals_overwrite)
    for broken, right in zip(_readers(str(_fresh(residual, tmp_path, "r2")), RESIDUAL),
                             (r_restored, r_exported, folded)):
        assert not _equal(broken, right)

    # The rows a residual entry stores whole added onto older copies: the readers give other sums.
    whole, stored = _whole_rows(str(residual))
    assert 0 < whole < stored, (whole, stored)  # the chain holds rows of both modes
    monkeypatch.setattr(Coverage, "claim", _modes_ignored)
    for broken, right in zip(_readers(str(_fresh(residual, tmp_path, "r3")), RESIDUAL),
                             (r_restored, r_exported, folded)):
        assert not _equal(broken, right)

