"""The synthetic Criteo stream: determinism per (seed, rank, sample), resumable reading, learnable labels."""

from __future__ import annotations

import math

import pytest
import torch

from cnr_dlrm.data import (
    CHUNK,
    CRITEO_KAGGLE_CARDINALITIES,
    ClickDataset,
    DataConfig,
    ResumableReader,
    SyntheticCriteo,
    make_loader,
)
from cnr_torchrec.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.timeout(120)

CFG = DataConfig(scale=0.001, min_rows=8, batch_size=32)


@pytest.fixture(scope="module")
def stream() -> SyntheticCriteo:
    return SyntheticCriteo(CFG)


def _rows(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dense [N, 13], ids [N, 26], labels [N]) of a Batch, ids read back from its KJT per feature."""
    kjt = batch.sparse_features
    jts = kjt.to_dict()
    ids = []
    for key in kjt.keys():
        jt = jts[key]
        assert torch.all(jt.lengths() == 1)
        ids.append(jt.values())
    return batch.dense_features, torch.stack(ids, dim=1), batch.labels


def _cat(parts):
    return tuple(torch.cat(p) for p in zip(*parts))


def test_table_sizes_follow_criteo_kaggle_scaled():
    assert len(CRITEO_KAGGLE_CARDINALITIES) == 26
    cfg = DataConfig(scale=0.01, min_rows=16)
    rows = cfg.table_rows()
    for card, n in zip(CRITEO_KAGGLE_CARDINALITIES, rows):
        assert n == max(16, math.ceil(card * 0.01))
    assert max(rows) == math.ceil(10131227 * 0.01)  # C3, the largest Kaggle feature
    assert min(rows) == 16


def test_sample_is_the_same_whatever_the_batch_size(stream):
    n = 3 * CHUNK + 17  # crosses chunk boundaries at several offsets
    whole = _rows(stream.batch(rank=1, start=0, stop=n))
    for size in (1, 7, 64, CHUNK, 100):
        parts = [_rows(stream.batch(1, s, min(s + size, n))) for s in range(0, n, size)]
        got = _cat(parts)
        for a, b in zip(whole, got):
            assert torch.equal(a, b), f"batch size {size} changed the samples"
    # A window starting mid-stream (a restart point) gives the same samples as well.
    mid = _rows(stream.batch(1, 150, 290))
    for a, b in zip(whole, mid):
        assert torch.equal(a[150:290], b)


def test_streams_differ_by_rank_split_and_seed(stream):
    base = _rows(stream.batch(0, 0, 256))
    others = [
        _rows(stream.batch(1, 0, 256)),
        _rows(stream.batch(0, 0, 256, split="eval")),
        _rows(SyntheticCriteo(DataConfig(scale=0.001, min_rows=8, seed=1)).batch(0, 0, 256)),
    ]
    for o in others:
        assert not torch.equal(base[1], o[1])
        assert not torch.equal(base[0], o[0])
    # The same config in a new object (another process would do the same) gives the same samples.
    again = _rows(SyntheticCriteo(CFG).batch(0, 0, 256))
    for a, b in zip(base, again):
        assert torch.equal(a, b)


def test_batch_layout_fits_torchrec(stream):
    b = stream.batch(0, 0, 50)
    assert b.dense_features.shape == (50, 13) and b.dense_features.dtype == torch.float32
    assert b.labels.shape == (50,) and set(b.labels.unique().tolist()) <= {0.0, 1.0}
    assert b.sparse_features.keys() == [f"cat_{i}" for i in range(26)]
    dense, ids, _ = _rows(b)
    assert torch.all(dense >= 0)
    for t, n in enumerate(stream.table_rows):
        assert int(ids[:, t].min()) >= 0 and int(ids[:, t].max()) < n


def test_ids_follow_zipf():
    cfg = DataConfig(scale=0.001, min_rows=8, zipf=1.2)
    s = SyntheticCriteo(cfg)
    _, ids, _ = _rows(s.batch(0, 0, 20_000))
    t = 2  # C3, the largest table (10,132 rows here)
    n = s.table_rows[t]
    counts = torch.bincount(ids[:, t], minlength=n).double()
    observed = counts.sort(descending=True).values / counts.sum()
    k = torch.arange(1, n + 1, dtype=torch.float64)
    expected = k.pow(-1.2) / k.pow(-1.2).sum()
    # The hottest ranks carry the predicted mass (binomial noise on 20k draws is < 0.01 here).
    for r in range(5):
        assert abs(observed[r] - expected[r]) < 0.012, (r, observed[r], expected[r])
    assert abs(observed[:100].sum() - expected[:100].sum()) < 0.02
    # The hottest ids are scattered over the table, not packed at the start of one row shard.
    top = counts.argsort(descending=True)[:20]
    assert int((top < n // 2).sum()) not in (0, 20)


def test_labels_are_bernoulli_of_the_teacher_and_calibrated(stream):
    batch, logits = stream.generate(0, 0, 40_000)
    p = torch.sigmoid(logits)
    y = batch.labels.double()
    assert abs(y.mean().item() - CFG.ctr) < 0.02
    # Within each decile of the teacher's probability, the click rate matches the mean probability.
    order = p.argsort()
    for chunk in order.chunk(10):
        assert abs(y[chunk].mean().item() - p[chunk].mean().item()) < 0.03


def test_teacher_logloss_is_well_below_the_label_entropy(stream):
    batch, logits = stream.generate(0, 0, 20_000, split="eval")
    y = batch.labels.double()
    rate = y.mean().item()
    entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    teacher = torch.nn.functional.binary_cross_entropy_with_logits(logits, y).item()
    assert teacher < entropy - 0.1, (teacher, entropy)


def test_task_is_learnable_by_a_small_student(stream):
    """A logistic model over id embeddings and dense features, trained briefly, beats the label entropy."""
    torch.manual_seed(0)
    offsets = torch.tensor([0] + stream.table_rows[:-1]).cumsum(0)
    emb = torch.nn.EmbeddingBag(sum(stream.table_rows), 1, mode="sum")
    torch.nn.init.zeros_(emb.weight)
    lin = torch.nn.Linear(13, 1)
    opt = torch.optim.Adagrad(list(emb.parameters()) + list(lin.parameters()), lr=0.1)
    for i in range(60):
        dense, ids, y = _rows(stream.batch(0, i * 512, (i + 1) * 512))
        logit = emb(ids + offsets).squeeze(1) + lin(dense).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    dense, ids, y = _rows(stream.batch(0, 0, 8192, split="eval"))
    with torch.no_grad():
        ll = torch.nn.functional.binary_cross_entropy_with_logits(
            emb(ids + offsets).squeeze(1) + lin(dense).squeeze(1), y).item()
    rate = y.mean().item()
    entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    assert ll < entropy - 0.06, (ll, entropy)


def _sample_keys(batch) -> list[tuple]:
    """One hashable key per sample (its 26 ids and dense features), to find repeats and gaps."""
    dense, ids, _ = _rows(batch)
    return [tuple(i) + tuple(d) for i, d in zip(ids.tolist(), dense.tolist())]


@pytest.mark.parametrize("crash_after", [0, 1, 4, 9])
def test_reader_state_round_trip_with_pipeline_lookahead(stream, crash_after):
    """A pipeline reads 2 batches ahead; resuming from the reader's state trains every sample exactly once."""
    num = 10
    ds = ClickDataset(stream, rank=1, batch_size=24, num_batches=num)
    reference = [k for i in range(num) for k in _sample_keys(stream.batch(1, i * 24, (i + 1) * 24))]

    reader = ResumableReader(make_loader(ds))
    ahead = []
    trained = []
    it = iter(reader)
    for _ in range(crash_after):
        while len(ahead) < 3:  # the batch being trained and two read ahead
            try:
                ahead.append(next(it))
            except StopIteration:
                break
        trained += _sample_keys(ahead.pop(0))
        reader.step_done()
    if crash_after:
        assert len(ahead) == min(2, num - crash_after)  # read but not trained: must not be lost
    state = reader.state_dict()
    assert state["trained"] == crash_after

    resumed = ResumableReader(make_loader(ClickDataset(stream, rank=1, batch_size=24, num_batches=num)))
    resumed.load_state_dict(state)
    assert resumed.trained == crash_after
    for batch in resumed:
        trained += _sample_keys(batch)
        resumed.step_done()
    assert trained == reference  # nothing repeated, nothing skipped, in order
    assert resumed.trained == num


@pytest.mark.parametrize("workers", [0, 2])
def test_a_run_resumed_with_more_steps_reads_on_where_the_finished_one_stopped(stream, workers):
    """A job that ran to its end (loader exhausted) and is resumed with a longer train.steps."""
    short = ResumableReader(make_loader(ClickDataset(stream, rank=0, batch_size=16, num_batches=3), workers))
    for _ in short:
        short.step_done()
    longer = ResumableReader(make_loader(ClickDataset(stream, rank=0, batch_size=16, num_batches=5), workers))
    longer.load_state_dict(short.state_dict())
    got = [k for b in longer for k in _sample_keys(b)]
    assert got == [k for i in (3, 4) for k in _sample_keys(stream.batch(0, i * 16, (i + 1) * 16))]


def test_loader_with_workers_gives_the_same_batches(stream):
    ds = ClickDataset(stream, rank=0, batch_size=40, num_batches=4)
    a = [_rows(b) for b in make_loader(ds, num_workers=0)]
    b = [_rows(b) for b in make_loader(ds, num_workers=2)]
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            assert torch.equal(u, v)


def test_bad_reader_state_and_bad_ranges(stream):
    reader = ResumableReader(make_loader(ClickDataset(stream, 0, 8, 2)))
    with pytest.raises(CheckpointError, match="expected 'loader' and 'trained'"):
        reader.load_state_dict({"pos": 3})
    with pytest.raises(ValueError, match="split"):
        stream.batch(0, 0, 8, split="test")
    with pytest.raises(ValueError, match="start < stop"):
        stream.batch(0, 8, 8)
    with pytest.raises(IndexError):
        ClickDataset(stream, 0, 8, 2)[2]


@pytest.mark.parametrize(
    "kwargs, key",
    [({"scale": 0}, "scale"), ({"min_rows": 0}, "min_rows"), ({"zipf": -1}, "zipf"), ({"batch_size": 0}, "batch_size"),
     ({"ctr": 1.0}, "ctr"), ({"signal": float("nan")}, "signal"), ({"num_workers": -1}, "num_workers")],
)
def test_data_config_rejects_bad_values(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        DataConfig(**kwargs)
