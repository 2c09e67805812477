"""Applying a chain's entries to the shards a rank holds now (``cnr_torchrec/ckpt/restore/apply.py``).

``Applier`` is driven here through its own steps (``plan`` each entry newest checkpoint first, ``apply`` the rows
read, ``finish_checkpoint``, ``check_complete``, ``finish``), as ``restore/chain.py`` drives it, on chains that the
real ``Checkpointer`` wrote for the toy model (TorchRec's EBC and EC, FBGEMM's EXACT_ROWWISE_ADAGRAD). The
references are the live weights and row-wise Adagrad state at the last save, whole tables assembled from the
saving model's shards (column shards' states by their column-weighted mean), and, for a residual chain, the
chain's rule computed here with torch ops from each stored entry: a row is its newest whole copy plus every newer
residual, added oldest first.

The Applier is exercised through ``Checkpointer.restore`` elsewhere: every policy and codec against the live
model (``test_checkpointer_multirank.py``), TorchRec's models across plans and world sizes
(``test_torchrec_models.py``), the precedence rule broken once (``test_precedence_rule.py``), staging into the
residual reconstruction (``test_restore_memory.py``, ``test_memory_tier.py``), crafted entries
(``test_crafted_structure.py``) and scale-up's row blocks (``test_scale_up.py``).
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from _toy import build_dmp, train

from cnr_torchrec.ckpt.format.bytes.rows import RowReader
from cnr_torchrec.ckpt.format.bytes.storage import Storage
from cnr_torchrec.ckpt.format.commits import committed_ids, load_manifest, walk_chain
from cnr_torchrec.ckpt.format.precedence import closes, newest_first
from cnr_torchrec.ckpt.format.row_ids import stored_offsets
from cnr_torchrec.ckpt.restore.apply import Applier
from cnr_torchrec.errors import CorruptCheckpointError
from cnr_torchrec.quant import decode, rebuild

PLAIN = {"method": "none", "residual": False}
RESIDUAL = {"method": "adaptive", "bits": 4, "residual": True}
SHAPES = {"t0": (64, 8), "t1": (40, 8), "t2": (32, 4)}


def specs(layout: str = "A"):
    """The toy model's tables; layout "B" gives each table another sharding type (and EC for t2 in both)."""
    from examples.toy import TableSpec

    kinds = {"A": ("row_wise", "column_wise", "table_wise"), "B": ("column_wise", "table_wise", "row_wise")}[layout]
    return [TableSpec(name, rows, dim, kind, "ec" if name == "t2" else "ebc")
            for (name, (rows, dim)), kind in zip(SHAPES.items(), kinds)]


def whole_tables(tracker) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """This process's whole tables from its shards: (weights, row-wise Adagrad state), float64; a column shard's
    state counts by its share of the columns (its mean of squared gradients is over its own columns)."""
    out = {}
    for t in tracker.tables():
        rows, dim = SHAPES[t]
        w, m = torch.zeros(rows, dim, dtype=torch.float64), torch.zeros(rows, dtype=torch.float64)
        for k, s in tracker.shards(t):
            w[s.rows[0]:s.rows[1], s.cols[0]:s.cols[1]] = k.tbe.split_embedding_weights()[s.local_index].double()
            state = k.tbe.split_optimizer_states()[s.local_index][0].reshape(-1).double()
            m[s.rows[0]:s.rows[1]] += state * (s.cols[1] - s.cols[0]) / dim
        out[t] = (w, m)
    return out


def write_chain(root: str, quantization: dict, layout: str = "A", saves: int = 4):
    """A baseline and ``saves - 1`` deltas of the trained toy model, by the real Checkpointer (one rank). Returns
    the whole tables at the last save."""
    from cnr_torchrec import Checkpointer, load_config

    sp = specs(layout)
    dmp, opt = build_dmp(sp)
    gen = torch.Generator().manual_seed(0)
    config = load_config({"root": root, "policy": "consecutive", "keep_last": 10, "quantization": quantization})
    with Checkpointer(dmp, config, dense_optimizer=opt) as ck:
        for step in range(1, saves + 1):
            train(dmp, sp, opt, 2, gen)
            ck.save(step).wait()
    return whole_tables(dmp.dirty_tracker)


def chain_of(storage: Storage) -> list:
    """The newest checkpoint's chain, baseline first."""
    return walk_chain(load_manifest(storage, committed_ids(storage)[-1]), lambda i: load_manifest(storage, i))


def apply_chain(tracker, storage: Storage, manifests: list, tables=None) -> Applier:
    """The Applier's steps over ``manifests`` (baseline first), as a restore takes them: entries claimed newest
    checkpoint first; a plain chain's rows applied as they are claimed, a residual chain's oldest first."""
    applier = Applier(tracker, manifests)
    claimed = []
    for m in newest_first(manifests):
        if applier.done():
            break
        work = []
        for report in m.ranks:
            load = RowReader(storage, report.payload)
            for table, entry in m.rows_of(report, True):
                if applier.wants(table, entry) and (plan := applier.plan(table, entry, load)) is not None:
                    work.append((load, plan))
        if applier.additive:
            applier.refresh()
            claimed.append(work)
            continue
        for load, plan in work:
            applier.apply(plan, load.rows(plan.entry, plan.sel))
        applier.finish_checkpoint()
    for work in reversed(claimed):
        for load, plan in work:
            applier.apply(plan, load.rows(plan.entry, plan.sel))
        applier.finish_checkpoint()
    applier.check_complete(tracker, manifests[0], tracker.tables() if tables is None else tables)
    applier.finish().commit()
    return applier


def stored(storage: Storage, manifests: list):
    """Every entry of ``manifests`` (oldest first): (checkpoint id, table, global rows, cols, whole mask, float32
    rows), decoded by the entry's codec."""
    for m in manifests:
        for report in m.ranks:
            load = RowReader(storage, report.payload)
            for table, entry in m.rows_of(report, True):
                n = entry.num_stored
                offsets = stored_offsets(entry, load)
                rows = entry.rows[0] + (torch.arange(n) if offsets is None else offsets)
                whole = closes(entry, load)
                whole = torch.full((n,), whole) if isinstance(whole, bool) else whole
                blobs = load.rows(entry, torch.arange(n))
                if entry.replicated is not None:
                    vals = blobs[0].float()
                else:
                    keys = sorted(entry.coded.blobs)
                    vals = decode(rebuild(dict(zip(keys, blobs)), {**entry.coded.meta, "num_rows": n}))
                yield m.id, table, rows, entry.cols, whole, vals


def rule_reference(storage: Storage, manifests: list, shapes: dict | None = None) -> dict[str, torch.Tensor]:
    """The chain's rule, with torch ops: oldest checkpoint first, a whole copy replaces a row's columns and a
    residual adds onto them (float32), so each row ends as its newest whole copy plus the newer residuals,
    added oldest first."""
    out = {t: torch.zeros(shape) for t, shape in (shapes or SHAPES).items()}
    for _, table, rows, (c0, c1), whole, vals in stored(storage, manifests):
        cur = out[table][rows, c0:c1]
        out[table][rows, c0:c1] = torch.where(whole[:, None], vals, cur + vals)
    return out


def fresh_tracker(layout: str = "A"):
    dmp, _ = build_dmp(specs(layout), seed=7)
    return dmp, dmp.dirty_tracker


def test_a_plain_chain_gives_each_row_its_newest_copy_with_its_optimizer_state(group, tmp_path):
    live = write_chain(str(tmp_path / "root"), PLAIN)
    storage = Storage(str(tmp_path / "root"))
    manifests = chain_of(storage)
    assert len(manifests) == 4
    # Rows stored by more than one checkpoint of the chain: older copies that must lose.
    seen: dict[tuple, set] = {}
    for i, table, rows, cols, _, _ in stored(storage, manifests):
        for r in rows.tolist():
            seen.setdefault((table, r, cols), set()).add(i)
    assert sum(len(ids) > 2 for ids in seen.values()) > 20

    dmp, tracker = fresh_tracker()
    before = whole_tables(tracker)
    apply_chain(tracker, storage, manifests)
    got = whole_tables(tracker)
    reference = rule_reference(storage, manifests)
    storage.close()
    for t, (w, m) in live.items():
        assert not torch.equal(before[t][0], w), t  # the fresh model differs: the comparison is not vacuous
        assert torch.equal(got[t][0], w), (t, (got[t][0] - w).abs().max())
        assert torch.equal(got[t][0].float(), reference[t]), t
        assert torch.equal(got[t][1], m), (t, (got[t][1] - m).abs().max())


def test_a_residual_chain_adds_the_newer_residuals_onto_each_rows_newest_whole_copy(group, tmp_path):
    live = write_chain(str(tmp_path / "root"), RESIDUAL)
    storage = Storage(str(tmp_path / "root"))
    manifests = chain_of(storage)
    modes = [w for i, _, _, _, w, _ in stored(storage, manifests) if i != manifests[0].id]
    assert 0 < sum(int(w.sum()) for w in modes) < sum(w.numel() for w in modes)  # deltas of both modes

    dmp, tracker = fresh_tracker()
    applier = apply_chain(tracker, storage, manifests)
    assert applier.additive
    got = whole_tables(tracker)
    reference = rule_reference(storage, manifests)
    storage.close()
    for t, (w, _) in live.items():
        assert torch.equal(got[t][0].float(), reference[t]), (t, (got[t][0].float() - reference[t]).abs().max())
        # 4-bit rows: near the live ones, far nearer than the fresh model's.
        assert (got[t][0] - w).abs().max() < 0.1 * (whole_tables(fresh_tracker()[1])[t][0] - w).abs().max(), t


def test_entries_land_on_the_shards_that_overlap_them_under_another_plan(group, tmp_path):
    """Written with t0 row_wise, t1 two column shards, t2 table_wise; applied onto t0 in two column shards, t1
    whole and t2 row_wise: the weights are the saved ones, and a whole row's Adagrad state is the column-weighted
    mean of its column shards' (exact for the mean of squared gradients)."""
    live = write_chain(str(tmp_path / "root"), PLAIN)
    storage = Storage(str(tmp_path / "root"))
    dmp, tracker = fresh_tracker("B")
    assert len(tracker.shards("t0")) == 2 and len(tracker.shards("t1")) == 1
    apply_chain(tracker, storage, chain_of(storage))
    storage.close()
    got = whole_tables(tracker)
    for t, (w, m) in live.items():
        assert torch.equal(got[t][0], w), (t, (got[t][0] - w).abs().max())
        assert torch.allclose(got[t][1], m, rtol=1e-6, atol=0), (t, (got[t][1] - m).abs().max())
    # t0's column shards each took the saved row's state as it was.
    for k, s in tracker.shards("t0"):
        assert torch.equal(k.tbe.split_optimizer_states()[s.local_index][0].reshape(-1).double(), live["t0"][1])


def test_a_chain_without_its_baseline_is_refused_naming_a_row_no_entry_holds(group, tmp_path):
    write_chain(str(tmp_path / "root"), PLAIN)
    storage = Storage(str(tmp_path / "root"))
    deltas = chain_of(storage)[1:]
    held: dict[str, set] = {t: set() for t in SHAPES}
    for _, table, rows, _, _, _ in stored(storage, deltas):
        held[table] |= set(rows.tolist())
    dmp, tracker = fresh_tracker()
    first = next(t for t in tracker.tables() if len(held[t]) < SHAPES[t][0])
    row = min(set(range(SHAPES[first][0])) - held[first])
    with pytest.raises(CorruptCheckpointError, match=f"holds no copy of row {row} of table '{first}'"):
        apply_chain(tracker, storage, deltas)
    storage.close()


def _two_rank_writer(rank, world_size, root, out):
    """The chain written by 2 ranks (t0's rows split between them); rank 0 keeps the whole tables at the last
    save, assembled from both ranks' shards."""
    import torch.distributed as dist

    live = write_chain(root, PLAIN, saves=3)
    for t, (w, m) in live.items():
        dist.all_reduce(w)
        dist.all_reduce(m)
    if rank == 0:
        torch.save(live, out)


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_row_blocks_written_by_two_ranks_land_on_one_ranks_whole_table(group, tmp_path):
    root, out = str(tmp_path / "root"), str(tmp_path / "live.pt")
    run_ranks(_two_rank_writer, world_size=2, timeout=150, args=(root, out))
    live = torch.load(out)
    storage = Storage(root)
    manifests = chain_of(storage)
    blocks = {e.rows for r in manifests[0].ranks for t, e in manifests[0].rows_of(r, True) if t == "t0"}
    assert blocks == {(0, 32), (32, 64)}  # two row blocks, one per rank
    dmp, tracker = fresh_tracker("B")
    apply_chain(tracker, storage, manifests)
    storage.close()
    got = whole_tables(tracker)
    for t, (w, m) in live.items():
        assert torch.equal(got[t][0], w), (t, (got[t][0] - w).abs().max())
        assert torch.allclose(got[t][1], m, rtol=1e-6, atol=0), t
