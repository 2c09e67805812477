"""Lossless compaction (``compact`` with no method, :mod:`cnr_torchrec.ckpt.compact.merge`).

The reference is a restore no one here wrote differently: TorchRec's own test models
(tests/_torchrec_models.py) restored by the Checkpointer from the chain, against the same model
restored from the compacted baseline alone. Keeping every row's stored bytes, the two must be
equal bit for bit whatever the codec, the plans and the world sizes the chain was written under.
Hand-built chains check what no TorchRec job writes: ownership by first column, byte identity,
and a row that no stored piece holds whole.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch

import _torchrec_models as M
from _dist import run_ranks
from test_compaction import _bodies

COMPACT = {"params": {"bias_dtype": "float16"}, "state_dtype": "bfloat16"}
CODECS = [("none", None, {}), ("fp16", None, {}), ("bf16", None, {}), ("uniform_sym", 8, {}),
          ("uniform_asym", 2, COMPACT), ("kmeans", 3, {}), ("adaptive", 4, {})]
CODEC_IDS = [f"{m}{b or ''}{'_compact' * bool(x)}" for m, b, x in CODECS]


def _config(root, method="adaptive", bits=4, extra=None):
    from cnr_torchrec import load_config

    # Plain coding: these chains merge losslessly (residual chains fold: test_residual.py).
    quantization = {"method": method, "bits": bits, "residual": False, **(extra or {})}
    return load_config({"root": root, "policy": "consecutive", "quantization": quantization, "keep": {"chains": 20},
                        "restore_rng": True})  # a merge keeps the tip's RNG state: restores compare it


def _job(cfg, model, plan, saves, *, rank=0, seed=0, restore=False):
    """Trains ``model`` under ``plan`` and saves after each step. Returns (kinds, live state, last step);
    with ``restore`` it first restores the newest checkpoint (per-rank state dropped)."""
    from cnr_torchrec import Checkpointer

    dmp, opt = M.build_dmp(model, plan, seed=seed)
    ck = Checkpointer(dmp, cfg, dense_optimizer=opt)
    step = ck.restore(per_rank_state="drop") if restore else 0
    kinds = []
    for _ in range(saves):
        M.train_step(dmp, opt, M.make_batch(model, seed=1000 * step + rank))
        step += 1
        kinds.append(ck.save(step).wait().kind)
    live = M.local_state(dmp, opt)
    ck.close()
    return kinds, live, step


def _restored(cfg, model, plan, **kw):
    """A fresh model under ``plan`` restored from the newest checkpoint: (step, state, torch RNG state)."""
    from cnr_torchrec import Checkpointer

    dmp, opt = M.build_dmp(model, plan, seed=7)
    ck = Checkpointer(dmp, cfg, dense_optimizer=opt)
    step = ck.restore(**kw)
    ck.close()
    return step, M.local_state(dmp, opt), torch.get_rng_state()


def _untouched(model, plan):
    dmp, opt = M.build_dmp(model, plan, seed=7)
    return M.local_state(dmp, opt)


def _compact(root, **kw):
    from cnr_torchrec.ckpt.compact.offline import compact
    from cnr_torchrec.ckpt.format.bytes.storage import Storage

    storage = Storage(root)
    try:
        return compact(storage, **kw)
    finally:
        storage.close()


def _drop_chain(root, body):
    """Deletes the checkpoints ``body`` was compacted from: what restores now comes from ``body`` alone."""
    first, tip = body.compacted_from
    for i in range(first, tip + 1):
        shutil.rmtree(os.path.join(root, f"ckpt-{i:08d}"), ignore_errors=True)


def _assert_restores_alike(root, cfg, model, plans, body):
    """Restoring ``body`` alone equals restoring the chain it folded, under every plan of ``plans``.

    The chain is restored first (from a copy, with ``body`` removed), then the copy's chain is
    dropped and ``body`` restored there.
    """
    copy = root + "-check"
    shutil.copytree(root, copy)
    shutil.rmtree(os.path.join(copy, f"ckpt-{body.id:08d}"))
    os.remove(os.path.join(copy, "index.json"))
    from_chain = {plan: _restored(dataclasses.replace(cfg, root=copy), model, plan, per_rank_state="drop")
                  for plan in plans}
    shutil.rmtree(copy)
    _drop_chain(root, body)
    for plan in plans:
        got = _restored(cfg, model, plan, per_rank_state="drop")
        want = from_chain[plan]
        assert got[0] == want[0] == body.step
        M.assert_same(got[1], want[1], f"plan {plan}: compacted {body.id} vs chain {body.compacted_from}")
        assert torch.equal(got[2], want[2])
        untouched = _untouched(model, plan)
        assert any(not torch.equal(untouched[k], got[1][k]) for k in untouched if k[-1] == "w")  # not vacuous


def _weight_bytes(report):
    return sum(blob.nbytes for name, blob in report.blobs.items() if "/w/" in name)


def _coverage(storage, body):
    """Per table, how many stored pieces of ``body`` hold each (row, column): every cell must be held once."""
    from cnr_torchrec.ckpt.format.bytes.chunks import PayloadReader
    from cnr_torchrec.ckpt.format.row_ids import decode_ids

    grids = {t: torch.zeros(r, d, dtype=torch.int64) for t, (r, d) in body.tables.items()}
    for report in body.ranks:
        load = PayloadReader(storage, report.payload)
        for table, entries in report.tables.items():
            for e in entries:
                (r0, r1), (c0, c1) = e.rows, e.cols
                rows = torch.arange(r0, r1) if e.ids is None else decode_ids(e.ids.kind, load(e.ids.blob), r1 - r0) + r0
                grids[table][rows, c0:c1] += 1
    return grids


# ---------------------------------------------------------------------- every codec


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method,bits,extra", CODECS, ids=CODEC_IDS)
def test_compacted_chain_restores_bit_for_bit_for_every_codec(group, tmp_path, method, bits, extra):
    from cnr_torchrec.ckpt.format.bytes.storage import Storage

    root = str(tmp_path / "root")
    cfg = _config(root, method, bits, extra)
    kinds, live, step = _job(cfg, "sparse_nn", "A", 4)
    assert kinds == ["baseline", "delta", "delta", "delta"]

    body = _compact(root)
    assert (body.kind, body.compacted_from, body.equals, body.step) == ("baseline", (0, 3), 3, step)
    assert body.replicated == () and all(not r.replicated_tables for r in body.ranks)
    storage = Storage(root)
    try:
        # Every (row, column) of every table stored once, a row once per column block of the layout.
        for table, grid in _coverage(storage, body).items():
            assert bool((grid == 1).all()), table
        tip = _bodies(root)[3]
        blocks = sum(e["rows"][1] - e["rows"][0] for r in tip["ranks"] for es in r["tables"].values() for e in es)
        assert body.ranks[0].rows_written == blocks + sum(tip["tables"][t][0] for t in tip["replicated"])
    finally:
        storage.close()
    # Kept as stored: a quantized chain stays smaller than its rows in float32 (replicated tables are float32).
    f32 = sum(r * d * 4 for r, d in body.tables.values())
    if method == "none":
        assert _weight_bytes(body.ranks[0]) == f32
    else:
        assert _weight_bytes(body.ranks[0]) < f32

    _assert_restores_alike(root, cfg, "sparse_nn", ["A"], body)
    if method == "none":  # fp32 all along: the compacted baseline is the live model
        M.assert_same(_restored(cfg, "sparse_nn", "A")[1], live, "compacted fp32 chain vs the live model")


# ---------------------------------------------------------------------- plans and world sizes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method,bits,extra", [CODECS[0], CODECS[4]], ids=[CODEC_IDS[0], CODEC_IDS[4]])
def test_a_chain_across_a_plan_change_compacts_bit_for_bit(group, tmp_path, method, bits, extra):
    root = str(tmp_path / "root")
    cfg = _config(root, method, bits, extra)
    _job(cfg, "sparse_nn", "A", 2)
    # Plan B shards every table but one differently: replicated tables become sharded and the other way.
    kinds, _, _ = _job(cfg, "sparse_nn", "B", 2, seed=3, restore=True)
    assert kinds == ["delta", "delta"]
    body = _compact(root)
    assert body.compacted_from == (0, 3)
    _assert_restores_alike(root, cfg, "sparse_nn", ["B", "A"], body)


def _two_ranks(rank, world_size, root):
    _job(_config(root, "kmeans", 3), "mixed", "A", 2, rank=rank)


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_a_chain_across_a_change_of_world_size_compacts_bit_for_bit(group, tmp_path):
    root = str(tmp_path / "root")
    run_ranks(_two_ranks, world_size=2, timeout=200, args=(root,))

    # Two rank files merged by two ranks: each reads the others' files for the rows it owns.
    two = str(tmp_path / "two")
    shutil.copytree(root, two)
    body = _compact(two)
    assert body.world_size == 2 and body.compacted_from == (0, 1)
    _assert_restores_alike(two, _config(two, "kmeans", 3), "mixed", ["B"], body)

    # One rank goes on with the chain two ranks wrote, under another plan; then the whole chain compacts.
    cfg = _config(root, "kmeans", 3)
    kinds, _, _ = _job(cfg, "mixed", "B", 2, seed=3, restore=True)
    assert kinds == ["delta", "delta"]
    body = _compact(root)
    assert body.world_size == 1 and body.compacted_from == (0, 3)
    _assert_restores_alike(root, cfg, "mixed", ["B", "A"], body)


# ---------------------------------------------------------------------- compacting again


@pytest.mark.timeout(120)
def test_compacting_a_compacted_baseline_again_keeps_one_entry_per_block(group, tmp_path):
    root = str(tmp_path / "root")
    cfg = _config(root, "uniform_asym", 2, COMPACT)
    _job(cfg, "sparse_nn", "A", 3)
    first = _compact(root)
    kinds, _, _ = _job(cfg, "sparse_nn", "A", 2, seed=3, restore=True)
    assert kinds == ["delta", "delta"]  # on the compacted baseline
    second = _compact(root)
    assert second.compacted_from == (first.id, first.id + 2)

    def entries(body):
        return {t: len(es) for r in body.ranks for t, es in r.tables.items()}

    tip = _bodies(root)[first.id + 2]
    blocks = {t: len({(tuple(e["rows"]), tuple(e["cols"])) for e in es})
              for r in tip["ranks"] for t, es in r["tables"].items()}
    blocks.update({t: 1 for t in tip["replicated"]})
    # The baseline's rows and the deltas' rows of a block share columns, codec and state layout: one entry.
    assert entries(second) == entries(first) == blocks
    _assert_restores_alike(root, cfg, "sparse_nn", ["A"], second)


# ---------------------------------------------------------------------- hand-built chains


def _codec():
    from cnr_torchrec.quant import get_codec

    return get_codec("uniform_asym", 8)


def _add_entry(blobs, prefix, rows, cols, values, state, ids=None):
    """An entry as save writes it: rows ``values`` (one per stored row) encoded, a row-wise state."""
    encoded = _codec().encode(values)
    entry = {"rows": list(rows), "cols": list(cols), "encoding": "full" if ids is None else "rows"}
    if ids is not None:
        entry["ids"] = {"kind": "list", "count": len(ids),
                        "blob": blobs.add(f"{prefix}/ids", torch.tensor(ids, dtype=torch.int32) - rows[0])}
    entry["weights"] = {"meta": encoded.metadata(),
                        "blobs": {k: blobs.add(f"{prefix}/w/{k}", v) for k, v in encoded.to_tensors().items()}}
    entry["states"] = [{"rowwise": True, "blob": blobs.add(f"{prefix}/state0", state)}]
    return entry


def _write_ckpt(storage, ckpt_id, per_rank):
    """Checkpoint ``ckpt_id`` of table ``t`` (6 x 8), the ``ckpt_id``-th link of a chain on baseline 0:
    ``per_rank`` lists each rank's entries as (rows, cols, global row ids or None). Returns its manifest,
    as the schema check builds it from the body."""
    from cnr_torchrec.ckpt.format.bytes.payload import BlobWriter, checksum
    from cnr_torchrec.ckpt.format.commits import manifest_path, rank_file
    from cnr_torchrec.ckpt.format.schema import check_manifest

    ranks = []
    for rank, specs in enumerate(per_rank):
        blobs = BlobWriter()
        entries = []
        for i, (rows, cols, ids) in enumerate(specs):
            picked = list(range(*rows)) if ids is None else ids
            values = _table(ckpt_id)[picked][:, cols[0]:cols[1]].contiguous()
            state = torch.tensor([100.0 * ckpt_id + r for r in picked])
            entries.append(_add_entry(blobs, f"s{i}", rows, cols, values, state, ids))
        data = blobs.getvalue()
        file = rank_file(ckpt_id, rank)
        storage.write(file, data)
        stored = sum(e["ids"]["count"] if "ids" in e else e["rows"][1] - e["rows"][0] for e in entries)
        ranks.append({"rank": rank, "ok": True, "file": file, "nbytes": len(data), "xxh3": checksum(data),
                      "blobs": blobs.index, "tables": {"t": entries}, "replicated_tables": {}, "dense": {},
                      "tbe_iter": ckpt_id, "table_shapes": {"t": [6, 8]}, "rows_written": stored, "stall_ms": 0.0,
                      "write_ms": 0.0, "dense_optimizer": None, "extra": {}})
    body = {"id": ckpt_id, "step": ckpt_id, "kind": "delta" if ckpt_id else "baseline",
            "since": "previous" if ckpt_id else None, "parent": ckpt_id - 1 if ckpt_id else None, "base": 0,
            "depth": ckpt_id, "encodings": {"t": "rows"}, "reason": "test", "policy": "consecutive",
            "world_size": len(ranks), "codec": {}, "restores": 0, "tables": {"t": [6, 8]}, "table_fqns": {},
            "replicated": [], "nbytes": sum(r["nbytes"] for r in ranks), "created_unix": 0.0, "ranks": ranks}
    return check_manifest(json.loads(json.dumps(body)), manifest_path(ckpt_id))


def _table(ckpt_id):
    """Checkpoint ``ckpt_id``'s values of table ``t``: distinct per checkpoint, row and column."""
    return (torch.arange(48, dtype=torch.float32).reshape(6, 8) * 0.37 + ckpt_id * 10.0).sin()


def _merged(storage, chain, regions, rank=0):
    from cnr_torchrec.ckpt.compact.merge import CompactedFile, merge_rank

    return merge_rank(storage, chain, regions, CompactedFile(9, rank))


def _decoded(storage, report):
    """(cols, global rows, decoded rows, row-wise state, payload) per entry of a merged report (as written)."""
    from cnr_torchrec.ckpt.format.bytes.chunks import PayloadReader
    from cnr_torchrec.ckpt.format.row_ids import decode_ids
    from cnr_torchrec.ckpt.format.schema import check_payload
    from cnr_torchrec.quant import decode, rebuild

    load = PayloadReader(storage, check_payload(report, "merged"))
    out = []
    for e in report["tables"]["t"]:
        (r0, r1), cols = e["rows"], tuple(e["cols"])
        rows = torch.arange(r0, r1) if "ids" not in e else decode_ids(
            e["ids"]["kind"], load(e["ids"]["blob"]), r1 - r0) + r0
        encoded = rebuild({k: load(b) for k, b in e["weights"]["blobs"].items()}, e["weights"]["meta"])
        out.append((cols, rows.tolist(), decode(encoded), load(e["states"][0]["blob"]), encoded.payload))
    return out


@pytest.mark.timeout(30)
def test_each_piece_is_merged_by_the_region_of_its_first_column_with_its_stored_bytes(tmp_path):
    from cnr_torchrec.ckpt.format.blocks import Region
    from cnr_torchrec.ckpt.format.bytes.storage import Storage

    storage = Storage(str(tmp_path))
    # Baseline 0: two column shards on two ranks. Delta 1: one table-wise shard holding rows 1 and 4.
    chain = [_write_ckpt(storage, 0, [[((0, 6), (0, 4), None)], [((0, 6), (4, 8), None)]]),
             _write_ckpt(storage, 1, [[((0, 6), (0, 8), [1, 4])]])]
    left = _merged(storage, chain, [Region("t", (0, 6), (0, 4))])
    right = _merged(storage, chain, [Region("t", (0, 6), (4, 8))], rank=1)
    codec = _codec()

    def stored(ckpt_id, rows, cols):  # what a checkpoint's rows of those columns decode to
        return codec.decode(codec.encode(_table(ckpt_id)[rows][:, cols[0]:cols[1]].contiguous()))

    got = {cols: (rows, w, s, p) for cols, rows, w, s, p in _decoded(storage, left) + _decoded(storage, right)}
    # The delta's rows span both regions' columns but start in the left one: only the left one writes them.
    assert sorted(got) == [(0, 4), (0, 8), (4, 8)]
    assert got[(0, 8)][0] == [1, 4] and got[(0, 4)][0] == got[(4, 8)][0] == [0, 2, 3, 5]
    assert left["rows_written"] == 6 and right["rows_written"] == 4
    for cols, (rows, w, s, payload) in got.items():
        src = 1 if cols == (0, 8) else 0
        assert torch.equal(w, stored(src, rows, cols))
        assert torch.equal(payload, codec.encode(_table(src)[rows][:, cols[0]:cols[1]].contiguous()).payload)
        assert torch.equal(s, torch.tensor([100.0 * src + r for r in rows]))
    # Decoded into one table: the newest checkpoint's value of every row.
    table = torch.zeros(6, 8)
    for cols, (rows, w, _, _) in got.items():
        table[rows, cols[0]:cols[1]] = w
    ref = torch.cat([stored(0, list(range(6)), (0, 4)), stored(0, list(range(6)), (4, 8))], dim=1)
    ref[[1, 4]] = stored(1, [1, 4], (0, 8))
    assert torch.equal(table, ref)
    assert left["replicated_tables"] == {} and left["dense"] == {} and left["rng"] is None and left["tbe_iter"] == 1


@pytest.mark.timeout(30)
def test_a_row_no_stored_piece_holds_whole_raises_compaction_error_and_writes_nothing(tmp_path):
    from cnr_torchrec.ckpt.format.blocks import Region
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.commits import rank_file
    from cnr_torchrec.errors import CheckpointError, CompactionError

    storage = Storage(str(tmp_path))
    # Baseline 0 holds row 2 over columns [0, 8); delta 1 holds it over [0, 4) only: no stored row is whole.
    chain = [_write_ckpt(storage, 0, [[((0, 6), (0, 8), None)]]),
             _write_ckpt(storage, 1, [[((0, 6), (0, 4), [2])]])]
    with pytest.raises(CompactionError, match=r"table 't'.*checkpoint 0 stores row 2.*\[1\].*kept as it is") as e:
        _merged(storage, chain, [Region("t", (0, 6), (4, 8))])  # even where the row's piece is not owned
    assert isinstance(e.value, CheckpointError)
    assert not storage.exists(rank_file(9, 0))
    # Each piece whole, but row 2 from two checkpoints (columns [0, 4) from 0, [4, 8) from 1): a restore would
    # give its row-wise state the mean of both in one checkpoint, the newest one's from the chain.
    chain = [_write_ckpt(storage, 0, [[((0, 6), (0, 4), None), ((0, 6), (4, 8), None)]]),
             _write_ckpt(storage, 1, [[((0, 6), (4, 8), [2])]])]
    with pytest.raises(CompactionError, match=r"row 2 keeps columns stored by checkpoints \[0, 1\].*kept as it is"):
        _merged(storage, chain, [Region("t", (0, 6), (0, 8))])
    # Superseded whole (the delta spans the baseline's columns) is fine.
    chain[0] = _write_ckpt(storage, 0, [[((0, 6), (0, 8), None)]])
    chain[1] = _write_ckpt(storage, 1, [[((0, 6), (0, 8), [2])]])
    assert _merged(storage, chain, [Region("t", (0, 6), (0, 8))])["rows_written"] == 6


@pytest.mark.timeout(30)
def test_regions_of_a_layout_must_tile_every_table():
    from cnr_torchrec.ckpt.format.blocks import Region, regions_of_layout
    from cnr_torchrec.errors import CorruptCheckpointError

    def tip(blocks):
        """Checkpoint 5 of tables t (6 x 8, sharded into ``blocks`` per rank) and r (3 x 2, replicated)."""
        from cnr_torchrec.ckpt.format.manifest import Manifest, Payload, RankReport, TableEntry

        def report(k, bs):
            entries = tuple(TableEntry(rows=tuple(rows), cols=tuple(cols), encoding="full", weights=None)
                            for rows, cols in bs)
            return RankReport(rank=k, payload=Payload(f"ckpt-00000005/rank-{k:05d}.bin", 0, (), {}),
                              tables={"t": entries}, replicated_tables={"r": "rep/r"} if k == 0 else {}, dense={},
                              tbe_iter=0, table_shapes={}, rows_written=0, stall_ms=0.0, write_ms=0.0)

        return Manifest(id=5, step=5, kind="baseline", parent=None, base=5, depth=0, since=None, reason="test",
                        policy=None, world_size=len(blocks), codec={}, restores=0, tables={"t": (6, 8), "r": (3, 2)},
                        table_fqns={}, replicated=("r",), encodings={}, nbytes=0, created_unix=0.0,
                        ranks=tuple(report(k, bs) for k, bs in enumerate(blocks)))

    got = regions_of_layout(tip([[([0, 3], [0, 8])], [([3, 6], [0, 4]), ([3, 6], [4, 8])]]))
    assert got == {0: [Region("t", (0, 3), (0, 8)), Region("r", (0, 3), (0, 2))],
                   1: [Region("t", (3, 6), (0, 4)), Region("t", (3, 6), (4, 8))]}
    for bad in ([[([0, 3], [0, 8])], [([3, 6], [0, 4])]],  # a gap
                [[([0, 4], [0, 8])], [([3, 6], [0, 8])]]):  # an overlap
        with pytest.raises(CorruptCheckpointError, match="table 't'"):
            regions_of_layout(tip(bad))
