"""Cache-aware checkpoints of ``fused_uvm_caching`` TBEs, as far as FBGEMM allows on CPU.

FBGEMM's CPU TBE cannot hold a cache, so these tests give real TBEs of a real sharded
model a stand-in cache (a non-empty ``lxu_cache_weights``, FBGEMM's own test for one)
and record, on real save and restore paths, the order of cache write-backs
(``flush``), cache drops (``reset_cache_states``) and reads of the weights
(``split_embedding_weights``, which reads and writes the weights behind the cache).
The GPU plan (``tests/test_gpu.py``) checks a real cache against its weights.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from _toy import build_dmp, train

ROWS, DIM = 48, 4


def _specs():
    from examples.toy import TableSpec

    return [TableSpec("t_row_wise", ROWS, DIM, "row_wise"), TableSpec("t_table_wise", ROWS, DIM, "table_wise"),
            TableSpec("t_dp", ROWS, DIM, "data_parallel")]


class _Recorder:
    """Logs flushes, cache drops and weight reads of each sharded TBE, with a stand-in cache.

    The stand-in is there only inside :meth:`cached`: a CPU forward would try to fill it.
    """

    def __init__(self, tracker) -> None:
        self.events: list[str] = []
        self.tbes = [k.info.tbe for k in tracker._kernels if not k.info.data_parallel]
        for tbe in self.tbes:
            tbe.flush = self._log("flush", None)
            tbe.reset_cache_states = self._log("drop", None)
            tbe.split_embedding_weights = self._log("read", type(tbe).split_embedding_weights.__get__(tbe))

    def _log(self, what: str, real):
        def call(*args, **kwargs):
            self.events.append(what)
            return real(*args, **kwargs) if real is not None else None
        return call

    @contextlib.contextmanager
    def cached(self):
        empty = [tbe.lxu_cache_weights for tbe in self.tbes]
        for tbe in self.tbes:
            tbe.lxu_cache_weights = torch.zeros(2, DIM)
        self.events = []
        try:
            yield self.events
        finally:
            for tbe, e in zip(self.tbes, empty):
                tbe.lxu_cache_weights = e


@pytest.mark.timeout(120)
def test_saves_flush_before_reading_and_restores_drop_the_cache_after_writing(group, tmp_path):
    from cnr_torchrec import Checkpointer, load_config

    specs = _specs()
    dmp, opt = build_dmp(specs)
    rec = _Recorder(dmp.dirty_tracker)
    config = load_config({"root": str(tmp_path), "policy": "consecutive", "quantization": {"method": "none"}})
    ckpt = Checkpointer(dmp, config, dense_optimizer=opt)
    gen = torch.Generator().manual_seed(0)
    for step in (1, 2):  # a baseline, then a delta
        train(dmp, specs, opt, 2, gen)
        with rec.cached() as events:
            ckpt.save(step).wait()
        assert "read" in events and "drop" not in events
        assert events[: len(rec.tbes)] == ["flush"] * len(rec.tbes)  # every cache, before any read
    saved = {t: [k.tbe.split_embedding_weights()[s.local_index].clone() for k, s in dmp.dirty_tracker.shards(t)]
             for t in dmp.dirty_tracker.tables()}
    train(dmp, specs, opt, 2, gen)
    with rec.cached() as events:
        ckpt.restore()
    last_read = len(events) - 1 - events[::-1].index("read")
    first_read = events.index("read")
    # Before the first read, every cache is written back once: the copy a failed restore would put back
    # (restore_rollback) must hold the model's newest rows, which the cache has. After it, the cache's lines
    # are stale: never written back over the restored rows.
    assert events[:first_read] == ["flush"] * len(rec.tbes)
    assert "flush" not in events[first_read:]
    assert events[last_read + 1:] == ["drop"] * len(rec.tbes)  # every cache, after the last write
    for t, weights in saved.items():  # and the restore itself is exact
        for (k, s), w in zip(dmp.dirty_tracker.shards(t), weights):
            assert torch.equal(k.tbe.split_embedding_weights()[s.local_index], w), t
    ckpt.close()


@pytest.mark.timeout(60)
def test_a_tbe_without_a_cache_is_left_alone(group):
    from cnr_torchrec.track.tbe_cache import flush_caches, has_cache, invalidate_caches

    dmp, _ = build_dmp(_specs())
    tbes = dmp.dirty_tracker.tbes()
    assert not any(has_cache(t) for t in tbes)  # CPU TBEs: FBGEMM's lxu_cache_weights is empty
    before = [w.clone() for t in tbes for w in t.split_embedding_weights()]
    flush_caches(tbes)
    invalidate_caches(tbes)
    assert all(torch.equal(a, b) for a, b in zip(before, [w for t in tbes for w in t.split_embedding_weights()]))


@pytest.mark.timeout(60)
def test_a_cache_wider_than_its_weights_is_refused(group):
    from cnr_torchrec.errors import UnsupportedShardingError
    from cnr_torchrec.track.discovery import find_kernels
    from cnr_torchrec.track.tbe_cache import why_cache_inexact

    dmp, _ = build_dmp(_specs())
    tbe = dmp.dirty_tracker.shards("t_table_wise")[0][0].tbe
    tbe.lxu_cache_weights = torch.zeros(4, DIM, dtype=torch.float32)
    tbe.weights_uvm = torch.zeros(ROWS * DIM, dtype=torch.float16)  # as FBGEMM lays out fp16 UVM weights
    assert "float32 rows over torch.float16 weights" in why_cache_inexact(tbe)
    with pytest.raises(UnsupportedShardingError, match="t_table_wise.*cannot be checkpointed exactly"):
        find_kernels(dmp)
    tbe.lxu_cache_weights = torch.zeros(4, DIM, dtype=torch.float16)  # as wide as the weights: exact
    assert why_cache_inexact(tbe) is None
    find_kernels(dmp)
