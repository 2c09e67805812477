"""Checkpointer save/restore on gloo ranks, against independent references:

* the live model at save time (fp32 must restore exactly);
* the codec applied directly to the live rows (quantized restores must equal it bit for bit,
  since every codec works row by row);
* whole tables assembled from every rank's shards, for restores onto another plan and
  world size.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from _dist import run_ranks
from _toy import build_dmp, local_state, train

pytestmark = pytest.mark.multirank

ROWS, DIM = 400, 8
# Two plans over the same five tables: every table changes sharding type between them.
PLAN_A = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
PLAN_B = ("row_wise", "column_wise", "table_row_wise", "data_parallel", "table_wise")


def _build(world_size, plan=PLAN_A, seed=0, rows=ROWS):
    from examples.toy import TableSpec

    specs = [TableSpec(f"t{i}", rows, DIM, st, "ebc") for i, st in enumerate(plan)]
    dmp, opt = build_dmp(specs, seed=seed)
    return dmp, specs, opt


_train, _local_state = train, local_state


def _full_tables(dmp):
    """Whole tables assembled from every rank's shards: weights and the row-wise Adagrad state.

    A column shard keeps the mean of squared gradients over its own columns, so the
    whole-row state is the column-width-weighted mean of the shards' states.
    """
    tracker = dmp.dirty_tracker
    out = {}
    rank = dist.get_rank()
    for t in tracker.tables():
        w = torch.zeros(ROWS, DIM, dtype=torch.float64)
        m = torch.zeros(ROWS, dtype=torch.float64)
        dp = tracker.is_data_parallel(t)
        for k, s in tracker.shards(t):
            if dp and rank != 0:
                continue
            w[s.rows[0]:s.rows[1], s.cols[0]:s.cols[1]] = k.tbe.split_embedding_weights()[s.local_index].double()
            if not dp:
                state = k.tbe.split_optimizer_states()[s.local_index][0].reshape(-1).double()
                m[s.rows[0]:s.rows[1]] += state * (s.cols[1] - s.cols[0]) / DIM
        if dist.get_world_size() > 1:
            dist.all_reduce(w)
            dist.all_reduce(m)
        out[t] = (w, m, dp)
    return out


def _config(root, policy, method, bits, quant=None, **kw):
    from cnr_torchrec import load_config

    # Plain coding: each restored row is the codec's image of the live row (residual coding: test_residual.py).
    quantization = {"method": method, "bits": bits, "residual": False, **(quant or {})}
    return load_config({"root": root, "policy": policy, "quantization": quantization, **kw})


# uniform_asym 2-bit also uses the compact storage: float16 row bias and bfloat16 optimizer state.
COMPACT = {"params": {"bias_dtype": "float16"}, "state_dtype": "bfloat16"}
CODECS = [("none", None, None), ("adaptive", 4, None), ("uniform_asym", 2, COMPACT)]


def _round_trip_worker(rank, world_size, root, method, bits, quant):
    from cnr_torchrec import Checkpointer
    from cnr_torchrec.quant import get_codec

    codec = get_codec(method, bits, **(quant or {}).get("params", {}))
    state_dtype = getattr(torch, (quant or {}).get("state_dtype", "float32"))
    for policy in ("full", "one_shot", "consecutive", "intermittent"):
        where = os.path.join(root, policy)
        dmp, specs, opt = _build(world_size)
        ckpt = Checkpointer(dmp, _config(where, policy, method, bits, quant), dense_optimizer=opt)
        gen = torch.Generator().manual_seed(10 + rank)
        kinds = []
        for step in range(1, 7):  # a baseline and 5 deltas: the chain of 5 the issue asks for
            _train(dmp, specs, opt, 2, gen)
            kinds.append(ckpt.save(step * 2).wait().kind)
        want = {"full": ["baseline"] * 6, "one_shot": ["baseline"] + ["delta"] * 5,
                "consecutive": ["baseline"] + ["delta"] * 5}
        if policy in want:
            assert kinds == want[policy], (policy, kinds)
        saved = _local_state(dmp)
        opt_saved = opt.state_dict()
        dist.barrier()  # rank 0's last wait() returned after its garbage collection; let the others see it
        listed = ckpt.list()
        ckpt.close()
        if policy == "full":  # keep_last=2: only the last two chains (here: baselines) survive
            assert [i.id for i in listed] == [4, 5]
            assert sorted(os.listdir(where)) == ["ckpt-00000004", "ckpt-00000005", "index.json"]
        if policy == "consecutive":
            assert [len(i.chain) for i in listed][-1] == 6

        fresh, _, opt2 = _build(world_size, seed=1)
        before = _local_state(fresh)
        assert any(not torch.equal(before[k], saved[k]) for k in saved if k[-1] == "w")  # not vacuous
        restorer = Checkpointer(fresh, _config(where, policy, method, bits, quant), dense_optimizer=opt2)
        assert restorer.restore() == 12
        got = _local_state(fresh)
        for key, ref in saved.items():
            sharded = isinstance(key, tuple) and not fresh.dirty_tracker.is_data_parallel(key[0])
            if key[-1] == "w" and method != "none" and sharded:
                # The codec works row by row, so each restored row is the codec's image of the live row.
                # (data_parallel tables are stored in full precision, like the dense parameters.)
                ref = codec.decode(codec.encode(ref.float()))
            elif isinstance(key, tuple) and key[-1] != "w" and sharded:
                ref = ref.to(state_dtype).to(ref.dtype)  # optimizer row state, stored as state_dtype
            assert torch.equal(got[key], ref), (policy, method, key, (got[key] - ref).abs().max())
        for a, b in zip(opt2.state_dict()["state"].values(), opt_saved["state"].values()):
            assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
        restorer.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method,bits,quant", CODECS, ids=[f"{m}{b or ''}{'_compact' * bool(q)}" for m, b, q in CODECS])
def test_round_trip_every_policy(tmp_path, method, bits, quant):
    run_ranks(_round_trip_worker, world_size=2, timeout=240, args=(str(tmp_path), method, bits, quant))


def _save_worker(rank, world_size, root, plan, ref_path):
    from cnr_torchrec import Checkpointer

    dmp, specs, opt = _build(world_size, plan)
    ckpt = Checkpointer(dmp, _config(root, "consecutive", "none", None), dense_optimizer=opt)
    gen = torch.Generator().manual_seed(rank)
    for step in range(3):
        _train(dmp, specs, opt, 2, gen)
        ckpt.save(step).wait()
    infos = ckpt.list()
    ckpt.close()
    ckpt.close()  # idempotent
    from cnr_torchrec.errors import CheckpointerClosedError

    for use in (ckpt.list, lambda: ckpt.save(3), ckpt.restore, lambda: ckpt.recover([1])):
        with pytest.raises(CheckpointerClosedError, match="make a new Checkpointer"):
            use()
    assert [i.step for i in infos] == [0, 1, 2]
    ref = _full_tables(dmp)
    if rank == 0:
        torch.save({t: (w, m) for t, (w, m, _) in ref.items()}, ref_path)


def _restore_worker(rank, world_size, root, plan, ref_path):
    from cnr_torchrec import Checkpointer

    dmp, _, opt = _build(world_size, plan, seed=5)
    Checkpointer(dmp, _config(root, "consecutive", "none", None), dense_optimizer=opt).restore()
    ref = torch.load(ref_path, weights_only=True)
    got = _full_tables(dmp)
    for t, (w, m, dp) in got.items():
        assert torch.equal(w, ref[t][0]), (t, (w - ref[t][0]).abs().max())
        if not dp and ref[t][1].abs().sum() > 0:  # data_parallel tables keep no row-wise state
            torch.testing.assert_close(m, ref[t][1], rtol=1e-6, atol=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("src,dst", [(2, 1), (1, 2)], ids=["2to1", "1to2"])
def test_restore_onto_another_world_size_and_plan(tmp_path, src, dst):
    ref = str(tmp_path / "ref.pt")
    run_ranks(_save_worker, world_size=src, timeout=120, args=(str(tmp_path / "ck"), PLAN_A, ref))
    run_ranks(_restore_worker, world_size=dst, timeout=120, args=(str(tmp_path / "ck"), PLAN_B, ref))


def _continue_worker(rank, world_size, root, plan, ref_path):
    """Restores a chain written under another plan and world size, and extends it (consecutive goes on)."""
    from cnr_torchrec import Checkpointer

    dmp, specs, opt = _build(world_size, plan, seed=7)
    ckpt = Checkpointer(dmp, _config(root, "consecutive", "none", None), dense_optimizer=opt)
    ckpt.restore()
    gen = torch.Generator().manual_seed(100 + rank)
    for step in (10, 11):
        _train(dmp, specs, opt, 2, gen)
        assert ckpt.save(step).wait().kind == "delta"
    assert [len(i.chain) for i in ckpt.list()][-1] == 5  # 3 from the first plan, 2 from this one
    ckpt.close()
    ref = _full_tables(dmp)
    if rank == 0:
        torch.save({t: (w, m) for t, (w, m, _) in ref.items()}, ref_path)


@pytest.mark.timeout(300)
def test_chain_written_under_two_plans(tmp_path):
    """One chain, its checkpoints cut by different plans (column splits included), restored newest first."""
    root, ref = str(tmp_path / "ck"), str(tmp_path / "ref.pt")
    run_ranks(_save_worker, world_size=2, timeout=120, args=(root, PLAN_A, str(tmp_path / "unused.pt")))
    run_ranks(_continue_worker, world_size=1, timeout=120, args=(root, PLAN_B, ref))
    run_ranks(_restore_worker, world_size=2, timeout=120, args=(root, PLAN_A, ref))
    run_ranks(_restore_worker, world_size=1, timeout=120, args=(root, PLAN_B, ref))


def _failed_write_worker(rank, world_size, root):
    import errno

    from cnr_torchrec import Checkpointer, SaveFailedError
    from cnr_torchrec.ckpt.format.bytes import storage as storage_mod

    dmp, specs, opt = _build(world_size)
    ckpt = Checkpointer(dmp, _config(root, "consecutive", "none", None), dense_optimizer=opt)
    gen = torch.Generator().manual_seed(rank)
    _train(dmp, specs, opt, 2, gen)
    first = ckpt.save(1).wait()
    good = _local_state(dmp)

    real_write = storage_mod.Storage.write

    def full_disk(self, path, data):
        if rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return real_write(self, path, data)

    storage_mod.Storage.write = full_disk
    _train(dmp, specs, opt, 2, gen)
    handle = ckpt.save(2)
    with pytest.raises(SaveFailedError, match="No space left"):
        handle.wait()
    storage_mod.Storage.write = real_write
    dist.barrier()
    assert [i.id for i in ckpt.list()] == [first.id]
    assert not os.path.exists(os.path.join(root, f"ckpt-{first.id + 1:08d}"))  # partial files removed

    # Training went on; the next save starts a new baseline and commits.
    _train(dmp, specs, opt, 1, gen)
    after = ckpt.save(3).wait()
    assert after.kind == "baseline" and after.id == first.id + 2
    ckpt.close()

    fresh, _, opt2 = _build(world_size, seed=3)
    restorer = Checkpointer(fresh, _config(root, "consecutive", "none", None), dense_optimizer=opt2)
    assert restorer.restore(step=1) == 1
    got = _local_state(fresh)
    assert all(torch.equal(got[k], good[k]) for k in good)


@pytest.mark.timeout(300)
def test_failed_write_keeps_previous_checkpoint(tmp_path):
    run_ranks(_failed_write_worker, world_size=2, timeout=180, args=(str(tmp_path),))


class _Range(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def _reader_worker(rank, world_size, root, phase):
    from torchdata.stateful_dataloader import StatefulDataLoader

    from cnr_torchrec import Checkpointer

    dmp, specs, opt = _build(world_size)
    data = torch.utils.data.Subset(_Range(200), list(range(rank, 200, world_size)))
    loader = StatefulDataLoader(data, batch_size=4, shuffle=True,
                                generator=torch.Generator().manual_seed(7 + rank))
    ckpt = Checkpointer(dmp, _config(root, "consecutive", "none", None, restore_rng=True), dense_optimizer=opt,
                        extra_state={"reader": loader})
    log = os.path.join(root, f"seen-{rank}.txt")
    if phase == "train":
        it = iter(loader)
        seen = []
        for step in range(1, 9):
            seen += next(it).tolist()
            if step == 5:
                ckpt.save(step).wait()
                torch.save(torch.rand(3), log + ".rng")  # the draws the saved RNG state gives next
                with open(log, "w") as f:
                    f.write(" ".join(map(str, seen)))
        ckpt.close()
        return
    # Resume: the RNG continues where the checkpoint left it, and the samples already
    # trained (up to the checkpoint) are never seen again.
    torch.manual_seed(99)
    assert ckpt.restore() == 5
    assert torch.equal(torch.rand(3), torch.load(log + ".rng", weights_only=True))
    with open(log) as f:
        before = [int(x) for x in f.read().split()]
    after = [x for batch in loader for x in batch.tolist()]
    assert not set(before) & set(after)
    assert sorted(before + after) == list(range(rank, 200, world_size))


@pytest.mark.timeout(300)
def test_reader_state_round_trip(tmp_path):
    run_ranks(_reader_worker, world_size=2, timeout=120, args=(str(tmp_path), "train"))
    run_ranks(_reader_worker, world_size=2, timeout=120, args=(str(tmp_path), "resume"))


def _errors_worker(rank, world_size, root):
    from cnr_torchrec import (
        Checkpointer,
        CheckpointNotFoundError,
        ConfigError,
        CorruptCheckpointError,
        IncompatibleCheckpointError,
    )
    from examples.toy import TableSpec

    dmp, specs, opt = _build(world_size)
    with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint"):
        Checkpointer(dmp, _config(root, "consecutive", "none", None), dense_optimizer=opt).restore()
    with pytest.raises(ConfigError, match="CheckNRunDMP"):
        Checkpointer(dmp.module, _config(root, "consecutive", "none", None))
    ckpt = Checkpointer(dmp, _config(root, "consecutive", "none", None), dense_optimizer=opt)
    _train(dmp, specs, opt, 2, torch.Generator().manual_seed(0))
    ckpt.save(1).wait()
    _train(dmp, specs, opt, 2, torch.Generator().manual_seed(1))
    info = ckpt.save(2).wait()
    ckpt.close()
    with pytest.raises(CheckpointNotFoundError, match="step 7"):
        Checkpointer(dmp, _config(root, "consecutive", "none", None), dense_optimizer=opt).restore(step=7)

    # Another model: one more table, and a table of another width.
    from cnr_torchrec import CheckNRunDMP
    from examples.toy import ToyModel, build_plan, sharders_for
    from torchrec.distributed.types import ShardingEnv

    for extra in ([TableSpec("t5", ROWS, DIM, "row_wise")], []):
        other_specs = [TableSpec(s.name, s.rows, 16 if (not extra and s.name == "t1") else s.dim, s.sharding)
                       for s in specs] + extra
        model = ToyModel(other_specs)
        sharders = sharders_for(EmbOptimType.EXACT_ROWWISE_ADAGRAD, lr=0.05)
        other = CheckNRunDMP(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                             device=torch.device("cpu"), plan=build_plan(model, sharders, world_size),
                             sharders=sharders)
        with pytest.raises(IncompatibleCheckpointError, match="t5" if extra else "'t1' is 400 x 16"):
            Checkpointer(other, _config(root, "consecutive", "none", None)).restore()

    # A flipped byte in the latest payload: restore names the file (on_corrupt: fail; fallback is
    # covered in tests/test_corruption.py).
    victim = os.path.join(root, f"ckpt-{info.id:08d}", "rank-00000.bin")
    with open(victim, "r+b") as f:
        f.seek(3)
        b = f.read(1)
        f.seek(3)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(CorruptCheckpointError, match=f"ckpt-{info.id:08d}/rank-00000.bin") as e:
        config = _config(root, "consecutive", "none", None, on_corrupt="fail")
        Checkpointer(dmp, config, dense_optimizer=opt).restore()
    assert e.value.path == f"ckpt-{info.id:08d}/rank-00000.bin"


@pytest.mark.timeout(120)
def test_named_errors(tmp_path):
    run_ranks(_errors_worker, world_size=1, timeout=100, args=(str(tmp_path),))


def _skip_worker(rank, world_size, root):
    import threading

    from cnr_torchrec import Checkpointer
    from cnr_torchrec.ckpt.save import commit as ckpt_mod  # where the background write runs

    dmp, specs, opt = _build(world_size)
    ckpt = Checkpointer(dmp, _config(root, "consecutive", "none", None, on_busy="skip"), dense_optimizer=opt)
    gen = torch.Generator().manual_seed(0)
    _train(dmp, specs, opt, 2, gen)
    ckpt.save(1).wait()

    gate = threading.Event()
    real = ckpt_mod.write_rank

    def slow_write(*args, **kwargs):
        gate.wait(60)
        return real(*args, **kwargs)

    ckpt_mod.write_rank = slow_write
    _train(dmp, specs, opt, 2, gen)
    busy = ckpt.save(2)
    _train(dmp, specs, opt, 2, gen)
    skipped = ckpt.save(3)
    assert skipped.skipped and skipped.wait() is None and not busy.done()
    gate.set()
    ckpt_mod.write_rank = real
    assert busy.wait().kind == "delta"
    _train(dmp, specs, opt, 2, gen)  # rows of the skipped interval and of this one go into the next save
    last = ckpt.save(4).wait()
    assert last.chain == (0, 1, 2)
    saved = _local_state(dmp)
    ckpt.close()

    fresh, _, opt2 = _build(world_size, seed=1)
    assert Checkpointer(fresh, _config(root, "consecutive", "none", None), dense_optimizer=opt2).restore() == 4
    got = _local_state(fresh)
    assert all(torch.equal(got[k], saved[k]) for k in saved)


@pytest.mark.timeout(120)
def test_on_busy_skip_carries_rows_to_the_next_save(tmp_path):
    run_ranks(_skip_worker, world_size=1, timeout=100, args=(str(tmp_path),))
