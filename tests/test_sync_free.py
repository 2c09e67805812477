"""Sync-free tracking, the default for TBEs on CUDA, exercised on CPU with ``sync_free=True``.

On CUDA a read of device memory by the host (``item``, ``cpu``, ``tolist``,
``nonzero``, a boolean mask index, ...) makes the host wait for the stream and
stalls a pipeline's overlap. The tracking hooks must make none in a training
step: a lookup's problems stay on the device until a query raises them. On CPU
such calls cost nothing, so they are caught by name here, inside the hooks only:
torch's function and dispatch modes see every call the hooks make.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from _toy import build_dmp

ROWS, DIM = 40, 4

# Tensor methods and torch functions that read device memory on the host.
_HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
               "unique", "masked_select", "argwhere"}
# The aten ops behind them, for calls that reach the dispatcher another way.
_ATEN_READS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive"}


class _HostReads(TorchFunctionMode):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in _HOST_READS:
            self.seen.append(name)
        if name in ("to", "copy_") and any(_is_host(a) for a in list(args[1:]) + list((kwargs or {}).values())):
            self.seen.append(f"{name}(cpu)")
        if name == "__getitem__" and len(args) > 1 and _is_mask(args[1]):
            self.seen.append("mask index")
        return func(*args, **(kwargs or {}))


class _AtenReads(TorchDispatchMode):
    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _ATEN_READS:
            self.seen.append(f"aten.{func.overloadpacket.__name__}")
        return func(*args, **(kwargs or {}))


def _is_host(a) -> bool:
    return a == "cpu" or (isinstance(a, torch.device) and a.type == "cpu")


def _is_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


@contextlib.contextmanager
def _watched_hooks(tracker, seen: list[str]):
    """Runs every forward hook of the tracked TBEs under both modes, recording host reads."""
    def watch(fn):
        def wrapped(*args, **kwargs):
            with _HostReads(seen), _AtenReads(seen):
                return fn(*args, **kwargs)
        return wrapped

    patched = []
    for tbe in tracker.tbes():
        for hooks in (tbe._forward_pre_hooks, tbe._forward_hooks):
            for key, fn in list(hooks.items()):
                hooks[key] = watch(fn)
                patched.append((hooks, key, fn))
    try:
        yield
    finally:
        for hooks, key, fn in patched:
            hooks[key] = fn


def _specs():
    from examples.toy import TableSpec

    return [
        TableSpec("t_row_wise", ROWS, DIM, "row_wise", "ebc"),
        TableSpec("t_table_wise", ROWS, DIM, "table_wise", "ebc"),
        TableSpec("e_row_wise", ROWS, DIM, "row_wise", "ec"),
    ]


def _batch(specs, seed):
    from examples.toy import zipf_batch

    return zipf_batch(specs, batch_size=8, pooling=3, generator=torch.Generator().manual_seed(seed), alpha=1.1)


def _step(dmp, opt, batch):
    dmp(batch).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("counting", [None, "mfu", "ssu"])
def test_a_tracked_step_reads_nothing_on_the_host(group, counting):
    specs = _specs()
    dmp, opt = build_dmp(specs, sync_free=True)
    tracker = dmp.dirty_tracker
    if counting:
        tracker.enable_counting(counting, rate=0.3)
    _step(dmp, opt, _batch(specs, 0))  # warm-up: one-time set-up may read on the host
    seen: list[str] = []
    with _watched_hooks(tracker, seen):
        _step(dmp, opt, _batch(specs, 1))
    assert seen == []
    # The detector itself: a hook that reads on the host is caught.
    def reads_on_the_host(module, args):
        module.hash_size_cumsum[-1].item()

    probe = tracker.tbes()[0].register_forward_pre_hook(reads_on_the_host)
    try:
        with _watched_hooks(tracker, seen):
            _step(dmp, opt, _batch(specs, 2))
    finally:
        probe.remove()
    assert seen == ["item", "aten._local_scalar_dense"]


@pytest.mark.timeout(120)
def test_a_bad_id_is_raised_at_the_next_query_and_stays(group):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from cnr_torchrec.errors import RowIdOutOfRangeError

    specs = _specs()
    dmp, opt = build_dmp(specs, sync_free=True)
    tracker = dmp.dirty_tracker
    assert not tracker.fused_bounds_check  # FBGEMM keeps its own check: ours comes after the lookup
    good = _batch(specs, 0)
    start = int(good.offset_per_key()[good.keys().index("t_table_wise_f")])
    values = good.values().clone()
    values[start] = ROWS + 3
    bad = KeyedJaggedTensor(keys=good.keys(), values=values, lengths=good.lengths())
    _step(dmp, opt, bad)  # no error in the step itself
    for query in (lambda: tracker.dirty_rows("t_table_wise"), tracker.dirty_counts, tracker.check_lookups):
        with pytest.raises(RowIdOutOfRangeError, match=rf"'t_table_wise' was looked up with id {ROWS + 3}"):
            query()
    tracker.dirty_rows("t_row_wise")  # a table whose TBE saw no bad id answers


@pytest.mark.timeout(120)
def test_the_record_is_read_once_per_interval_of_lookups(group, monkeypatch):
    # Each read of a TBE's record is a host sync on CUDA, and a save queries the tracker many times.
    from cnr_torchrec import ops

    specs = _specs()
    dmp, opt = build_dmp(specs, sync_free=True)
    tracker = dmp.dirty_tracker
    reads: list[torch.Tensor] = []
    real = ops.raise_lookup_errors
    monkeypatch.setattr(ops, "raise_lookup_errors", lambda errors: (reads.append(errors), real(errors))[1])
    _step(dmp, opt, _batch(specs, 0))
    tracker.dirty_counts()
    for table in tracker.tables():
        tracker.dirty_rows(table)
    assert len(reads) == len(tracker.tbes())  # every TBE once, however many queries
    _step(dmp, opt, _batch(specs, 1))
    tracker.dirty_counts()
    assert len(reads) == 2 * len(tracker.tbes())  # new lookups: read again


def _bad_save_worker(rank: int, world_size: int, root: str) -> None:
    import time

    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from cnr_torchrec import Checkpointer, load_config
    from cnr_torchrec.errors import RowIdOutOfRangeError

    specs = _specs()
    dmp, opt = build_dmp(specs, sync_free=True)
    config = load_config({"root": root, "policy": "consecutive", "quantization": {"method": "none"}})
    ckpt = Checkpointer(dmp, config, dense_optimizer=opt)
    _step(dmp, opt, _batch(specs, rank))
    ckpt.save(1).wait()
    batch = _batch(specs, 10 + rank)
    if rank == 1:  # one rank's input only: the table's shard on either rank records it
        values = batch.values().clone()
        values[int(batch.offset_per_key()[batch.keys().index("t_table_wise_f")])] = ROWS + 3
        batch = KeyedJaggedTensor(keys=batch.keys(), values=values, lengths=batch.lengths())
    _step(dmp, opt, batch)
    t0 = time.monotonic()
    with pytest.raises(RowIdOutOfRangeError, match=rf"'t_table_wise' was looked up with id {ROWS + 3}"):
        ckpt.save(2)
    assert time.monotonic() - t0 < 30  # raised on every rank, no rank left waiting in a collective
    ckpt.close()


@pytest.mark.multirank
@pytest.mark.timeout(180)
def test_a_bad_lookup_on_one_rank_fails_the_next_save_on_every_rank(tmp_path):
    from _dist import run_ranks

    run_ranks(_bad_save_worker, world_size=2, timeout=150, args=(str(tmp_path / "ckpt"),))
