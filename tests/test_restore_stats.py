"""What a restore reports (``Checkpointer.last_restore_stats``): its phases and the bytes it read."""

from __future__ import annotations

import os

import torch

from cnr_torchrec.ckpt.format.commits import (
    load_manifest,
)
from cnr_torchrec.ckpt.format.bytes.storage import Storage


def test_a_restore_says_where_its_time_went(group, tmp_path):
    """last_restore_stats: every phase of restore/stats.py timed once the chain is applied, the top-level
    phases adding up to no more than the restore's own wall time, and the bytes read those of the files."""
    import time

    from _toy import build_dmp, train

    from cnr_torchrec import Checkpointer, load_config
    from cnr_torchrec.ckpt.restore.stats import COUNTS, PHASES
    from examples.toy import TableSpec

    specs = [TableSpec("t0", 400, 8, "table_wise", "ebc"), TableSpec("t1", 300, 4, "row_wise", "ebc")]
    dmp, opt = build_dmp(specs)
    # The phases of a restore from storage: without the memory tier, the in-job restore would take the image.
    config = load_config({"root": str(tmp_path), "policy": "consecutive", "memory_tier": "off"})
    gen = torch.Generator().manual_seed(0)
    with Checkpointer(dmp, config, dense_optimizer=opt) as ck:
        for step in (1, 2, 3):
            train(dmp, specs, opt, 1, gen)
            ck.save(step).wait()
        assert ck.last_restore_stats == {}
        t0 = time.perf_counter()
        assert ck.restore() == 3
        wall_ms = (time.perf_counter() - t0) * 1e3
        stats = ck.last_restore_stats
    assert set(stats) <= set(PHASES) | set(COUNTS), stats
    assert stats["from_memory"] == 0.0 and stats["memory_ranks"] == 0.0
    for phase in ("resolve_ms", "manifests_ms", "check_ms", "stage_ms", "plan_ms", "apply_ms", "state_ms",
                  "agree_ms"):
        assert stats.get(phase, 0) > 0, (phase, stats)
    # Disjoint parts of the restore (the shards' set-up is timed apart from the plan).
    top = ("resolve_ms", "check_ms", "stage_ms", "plan_ms", "apply_ms", "state_ms", "agree_ms")
    assert sum(stats[p] for p in top) <= wall_ms, (stats, wall_ms)
    assert stats["manifests_ms"] <= stats["resolve_ms"] and stats.get("read_wait_ms", 0) <= stats["apply_ms"]
    files = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(tmp_path) for f in fs
                if f.startswith("rank-"))
    assert 0 < stats["minimal_bytes"] <= stats["bytes_read"] <= files and stats["reads"] > 0


def test_minimal_bytes_of_a_baseline_are_its_rows_as_stored(group, tmp_path):
    """A restore of one baseline applies every stored row: its minimal bytes are the weight and optimizer-state
    blobs of every entry the manifest lists, with their CRCs (ids, dense and RNG state left out)."""
    from _toy import build_dmp, train

    from cnr_torchrec import Checkpointer, load_config
    from examples.toy import TableSpec

    specs = [TableSpec("t0", 400, 8, "table_wise", "ebc"), TableSpec("t1", 300, 4, "column_wise", "ebc"),
             TableSpec("t2", 50, 4, "data_parallel", "ebc")]
    dmp, opt = build_dmp(specs)
    with Checkpointer(dmp, load_config({"root": str(tmp_path), "policy": "full"}), dense_optimizer=opt) as ck:
        train(dmp, specs, opt, 1, torch.Generator().manual_seed(0))
        info = ck.save(1).wait()
        ck.restore()
        stats = ck.last_restore_stats
    storage = Storage(str(tmp_path))
    m = load_manifest(storage, info.id)
    storage.close()
    want = 0
    for report, _, e in m.entries():
        want += sum(report.blobs[n].nbytes for n in [*e.weights.blobs.values(), *(s.blob for s in e.states),
                                                       e.checks.blob])
    for report in m.ranks:
        want += sum(report.blobs[n].nbytes for n in report.replicated_tables.values())
    assert m.replicated and stats["minimal_bytes"] == want, (stats, want)
