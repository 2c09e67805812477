"""A job scaled up (1 -> 2 ranks, 2 -> 4) restores every row, with no data_parallel table to hide a gap.

On another world size a rank reads only the parts whose rows overlap its shards (format/placement.py). A
data_parallel table makes rank 0 read every part anyway, so these tables are sharded only: row-wise of an
uneven row count (101 rows: the new blocks end inside the old ones), column-wise and table-wise. The
reference is what the writing job itself restores on its own plan (each rank reading its own part), gathered
by global row and column: each rank of the larger job must restore exactly those values, weights and
row-wise optimizer state alike.
"""

from __future__ import annotations

import json

import pytest
import torch
from _dist import run_ranks
from _toy import build_dmp, train


def _specs():
    from examples.toy import TableSpec

    return [TableSpec("rw", 101, 8, "row_wise"), TableSpec("cw", 40, 8, "column_wise"),
            TableSpec("tw", 30, 4, "table_wise")]


def _config(root):
    from cnr_torchrec import load_config

    return load_config({"root": root, "policy": "consecutive", "memory_tier": "off"})


def _shards(dmp):
    """This rank's shards by (table, rows, cols): weights and row-wise optimizer state, as lists."""
    out = {}
    tracker = dmp.dirty_tracker
    for t in tracker.tables():
        for k, s in tracker.shards(t):
            states = k.tbe.split_optimizer_states()[s.local_index]
            out[json.dumps([t, list(s.rows), list(s.cols)])] = {
                "w": k.tbe.split_embedding_weights()[s.local_index].tolist(),
                "state": [st.reshape(-1).tolist() for st in states]}
    return out


def _write_and_restore(rank, world_size, root, out):
    """A baseline and two residual deltas; then a fresh model restores them on this plan: the reference."""
    from cnr_torchrec import Checkpointer

    dmp, opt = build_dmp(_specs(), seed=0)
    gen = torch.Generator().manual_seed(rank)
    with Checkpointer(dmp, _config(root), dense_optimizer=opt) as ck:
        for step in (1, 2, 3):
            train(dmp, _specs(), opt, 2, gen)
            ck.save(step).wait()
    fresh, fresh_opt = build_dmp(_specs(), seed=1)
    with Checkpointer(fresh, _config(root), dense_optimizer=fresh_opt) as ck:
        assert ck.restore() == 3
    with open(f"{out}.{rank}", "w") as f:
        json.dump(_shards(fresh), f)


def _restore_onto_more(rank, world_size, root, out):
    from cnr_torchrec import Checkpointer

    dmp, opt = build_dmp(_specs(), seed=2)
    with Checkpointer(dmp, _config(root), dense_optimizer=opt) as ck:
        assert ck.restore(per_rank_state="drop") == 3
    with open(f"{out}.{rank}", "w") as f:
        json.dump(_shards(dmp), f)


def _by_cell(files):
    """{table: {(row, col): (weight, row-wise states)}} from the shards the ranks wrote."""
    cells: dict[str, dict[tuple[int, int], tuple[float, tuple[float, ...]]]] = {}
    for path in files:
        for key, shard in json.load(open(path)).items():
            table, rows, cols = json.loads(key)
            for i, row in enumerate(shard["w"]):
                for j, w in enumerate(row):
                    state = tuple(s[i] for s in shard["state"] if len(s) == rows[1] - rows[0])
                    cells.setdefault(table, {})[(rows[0] + i, cols[0] + j)] = (w, state)
    return cells


@pytest.mark.parametrize("before,after", [(1, 2), (2, 4)])
def test_a_job_scaled_up_restores_every_row_of_its_sharded_tables(tmp_path, before, after):
    root, ref, got = str(tmp_path / "root"), str(tmp_path / "ref"), str(tmp_path / "got")
    run_ranks(_write_and_restore, before, args=(root, ref))
    run_ranks(_restore_onto_more, after, args=(root, got))
    want = _by_cell([f"{ref}.{r}" for r in range(before)])
    have = _by_cell([f"{got}.{r}" for r in range(after)])
    assert set(have) == set(want) == {s.name for s in _specs()}
    for table, cells in want.items():
        assert set(have[table]) == set(cells), table
        wrong = [cell for cell, (w, _) in cells.items() if have[table][cell][0] != w]
        assert not wrong, f"{table}: {len(wrong)} cells differ, first {sorted(wrong)[:3]}"
        # Row-wise state is one value per row of a column shard: compared where both sides hold one.
        diff = [cell for cell, (_, st) in cells.items() if st and have[table][cell][1] and have[table][cell][1] != st]
        assert not diff, f"{table}: row-wise state differs at {sorted(diff)[:3]}"


def test_rows_that_no_part_a_rank_reads_holds_are_named_never_left_stale(group, tmp_path, monkeypatch):
    """Whichever reader bug leaves a rank without the parts that hold some of its rows (placement above was one),
    the restore's own account names the rows: they would otherwise keep whatever the model held."""
    from cnr_torchrec import Checkpointer
    from cnr_torchrec.ckpt.restore import chain
    from cnr_torchrec.errors import RestoreFailedError

    root = str(tmp_path / "root")
    dmp, opt = build_dmp(_specs(), seed=0)
    with Checkpointer(dmp, _config(root), dense_optimizer=opt) as ck:
        for step in (1, 2):
            train(dmp, _specs(), opt, 2, torch.Generator().manual_seed(0))
            ck.save(step).wait()
    reports_for = chain.reports_for
    monkeypatch.setattr(chain, "reports_for", lambda m, *a: [] if m.kind == "baseline" else reports_for(m, *a))
    fresh, fresh_opt = build_dmp(_specs(), seed=1)
    with Checkpointer(fresh, _config(root), dense_optimizer=fresh_opt) as ck:
        with pytest.raises(RestoreFailedError, match=r"holds no copy of row \d+ of table '(rw|cw|tw)'"):
            ck.restore()
