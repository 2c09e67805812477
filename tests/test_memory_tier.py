"""The memory tier: each rank's restore image in host shared memory, taken by a restart that agrees with it.

Every check compares a restore that took the image with a restore of the same checkpoint into a freshly
built model with the memory tier off (which reads storage alone), state for state and bit for bit:

- on the toy model (a row-wise and a table-wise table, TorchRec's EXACT_ROWWISE_ADAGRAD), residual and
  plain (``memory_tier: on``) coding, across saves after a restore and across a background fold;
- the residual reconstruction, which the image keeps, is a storage restore of the chain to the bit;
- crafted images (a flipped byte, another layout, another root, truncated, a symlink, another user's
  file, readable by others) are refused by name, and the rank reads storage;
- the lifecycle: each root's images in a directory of its own, another root's kept when a root is opened,
  a clean close removes the rank's, an exception keeps it for the restart, and a directory without room
  means storage, with a warning (tests/test_memory_dirs.py: several jobs on one host, and when images go);
- TorchRec's TestSparseNN (shared tables, weighted features, EBC sharding types) and its mixed
  EmbeddingCollection model on 2 ranks: both ranks from memory, then one "host" lost (rank 1's image
  deleted: a mixed restore), then a restore onto another plan, which never uses an image;
- TorchRec's managed-collision EBC (sort-zch, LFU evictions): the by-row state comes from the image too.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from _toy import build_dmp, local_state, train


def _specs():
    from examples.toy import TableSpec

    return [TableSpec("t0", 64, 8, "row_wise"), TableSpec("t1", 32, 4, "table_wise")]


def _config(root, shm, mode="auto", residual=True, **kw):
    from cnr_torchrec import load_config

    return load_config({"root": root, "keep_last": 10, "on_corrupt": "fail",
                        "quantization": {"method": "adaptive", "bits": 4, "residual": residual},
                        "memory_tier": {"mode": mode, "path": shm}, **kw})


def _job(root, shm, saves=4, **kw):
    """A job that saves ``saves`` times and stops as a killed one would: its image stays. Returns its state at
    the last save."""
    from cnr_torchrec import Checkpointer

    specs = _specs()
    dmp, opt = build_dmp(specs)
    gen = torch.Generator().manual_seed(0)
    ck = Checkpointer(dmp, _config(root, shm, **kw), dense_optimizer=opt)
    for step in range(1, saves + 1):
        train(dmp, specs, opt, 2, gen)
        ck.save(step).wait()
    ck.close(keep_images=True)
    return local_state(dmp)


def _restart(root, shm, seed, will_restore=False, **kw):
    """A fresh process's restore: (its state, where each rank took its shards, its stats). ``will_restore``: as
    CheckNRunDMP takes it (the tables' initial values not drawn, and the image copied in one pass)."""
    from cnr_torchrec import Checkpointer

    dmp, opt = build_dmp(_specs(), seed=seed, will_restore=will_restore)
    ck = Checkpointer(dmp, _config(root, shm, **kw), dense_optimizer=opt)
    ck.restore()
    out = local_state(dmp), ck.last_restore_sources, ck.last_restore_stats
    ck.close(keep_images=True)
    return out


def _storage_restore(root, shm, **kw):
    state, sources, _ = _restart(root, shm, seed=11, mode="off", **kw)
    assert [s for _, s, _ in sources] == ["storage"]
    return state


def _assert_same(got, want):
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), (k, (got[k] - v).abs().max())


def _files(shm):
    """Every file under ``shm``, by its path relative to it (a root's images lie in a directory of their own)."""
    return sorted(os.path.relpath(os.path.join(d, f), shm) for d, _, files in os.walk(shm) for f in files)


def _image_dir(shm, root):
    """The directory of ``root``'s images under ``shm``, relative to it."""
    from cnr_torchrec.ckpt.memory.directory import root_dir

    return os.path.basename(root_dir(shm, root))


def test_the_reconstruction_is_a_storage_restore_of_its_chain_to_the_bit(group, tmp_path):
    """Residual rows add up oldest copy first in every reader, as the writer builds them: after six residual
    deltas (rows with several residuals above their whole copy) the job's reconstruction is a fresh model's
    storage restore."""
    from cnr_torchrec import Checkpointer

    specs = _specs()
    root, shm = str(tmp_path / "root"), str(tmp_path / "shm")
    os.makedirs(shm)
    dmp, opt = build_dmp(specs)
    gen = torch.Generator().manual_seed(0)
    with Checkpointer(dmp, _config(root, shm, mode="off"), dense_optimizer=opt) as ck:
        for step in range(1, 8):
            train(dmp, specs, opt, 3, gen)
            ck.save(step).wait()
        rec = ck._committer.reconstruction
        held = {k[0]: rec.reference(k, None).clone() for k in rec._rows}
    restored = _storage_restore(root, shm)
    weights = {k[0]: t for k, t in restored.items() if isinstance(k, tuple) and k[2] == "w"}
    assert weights.keys() == held.keys()
    for table, t in weights.items():
        assert torch.equal(t, held[table]), (table, int((t != held[table]).sum()))


@pytest.mark.parametrize("mode,residual", [("auto", True), ("on", False)], ids=["residual", "plain_on"])
def test_a_restart_restores_from_its_image_the_bits_of_a_storage_restore(group, tmp_path, mode, residual):
    from cnr_torchrec import Checkpointer

    root, shm = str(tmp_path / "root"), str(tmp_path / "shm")
    os.makedirs(shm)
    _job(root, shm, mode=mode, residual=residual)
    d = _image_dir(shm, root)
    assert _files(shm) == [f"{d}/r00000.img", f"{d}/r00000.seal", f"{d}/root"]
    got, sources, stats = _restart(root, shm, seed=7, mode=mode, residual=residual)
    assert sources == [(0, "memory", "sealed for the agreed checkpoint")]
    assert stats["from_memory"] == 1.0 and stats["memory_ranks"] == 1.0
    _assert_same(got, _storage_restore(root, shm, residual=residual))

    # The job goes on from the image: its next deltas code against the image's rows, and the image follows.
    specs = _specs()
    dmp, opt = build_dmp(specs, seed=3)
    gen = torch.Generator().manual_seed(5)
    ck = Checkpointer(dmp, _config(root, shm, mode=mode, residual=residual), dense_optimizer=opt)
    step = ck.restore()
    for _ in range(2):
        train(dmp, specs, opt, 2, gen)
        step += 1
        assert ck.save(step).wait().kind == "delta"
    ck.close(keep_images=True)
    got, sources, _ = _restart(root, shm, seed=8, mode=mode, residual=residual)
    assert [s for _, s, _ in sources] == ["memory"]
    _assert_same(got, _storage_restore(root, shm, residual=residual))


def test_auto_keeps_no_image_with_plain_coding(group, tmp_path):
    root, shm = str(tmp_path / "root"), str(tmp_path / "shm")
    os.makedirs(shm)
    _job(root, shm, saves=2, residual=False)
    assert _files(shm) == []
    _, sources, _ = _restart(root, shm, seed=7, residual=False)
    assert sources[0][1] == "storage" and "only with residual coding" in sources[0][2]


def _flip(path):
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x01]))


def _edit_seal(path, **fields):
    with open(path) as f:
        body = json.load(f)
    body.update(fields)
    with open(path, "w") as f:
        json.dump(body, f)


def _symlink(path):
    os.rename(path, path + ".real")
    os.symlink(path + ".real", path)


CRAFTED = {
    "checksum": (lambda img, seal, mp: _flip(img), "does not match its seal's checksum"),
    "layout": (lambda img, seal, mp: _edit_seal(seal, layout="0" * 32), "layout differ"),
    "root": (lambda img, seal, mp: _edit_seal(seal, root="0" * 16), "root differ"),
    "truncated": (lambda img, seal, mp: os.truncate(img, os.path.getsize(img) - 64), "truncated"),
    "symlink": (lambda img, seal, mp: _symlink(img), "is a symlink"),
    "other_user": (lambda img, seal, mp: mp.setattr(os, "getuid", lambda: 4242), "belongs to uid"),
    "readable": (lambda img, seal, mp: os.chmod(img, 0o644), "an image is 0600"),
}


@pytest.mark.parametrize("will_restore", [False, True], ids=["checked_first", "one_pass"])
@pytest.mark.parametrize("craft", sorted(CRAFTED))
def test_a_crafted_image_is_refused_by_name_and_the_rank_reads_storage(group, tmp_path, monkeypatch, craft,
                                                                       will_restore):
    """Checked before its rows are taken, or as they are copied into a model whose weights were never
    initialised (``will_restore``): either way the rank reads storage, and restores what storage holds."""
    from cnr_torchrec.ckpt.memory.tier import image_stem

    root, shm = str(tmp_path / "root"), str(tmp_path / "shm")
    os.makedirs(shm)
    _job(root, shm)
    want = _storage_restore(root, shm)
    stem = image_stem(shm, root, 0)
    edit, why = CRAFTED[craft]
    edit(stem + ".img", stem + ".seal", monkeypatch)
    got, sources, stats = _restart(root, shm, seed=7, will_restore=will_restore)
    assert sources[0][1] == "storage" and why in sources[0][2], sources
    assert stats["from_memory"] == 0.0
    _assert_same(got, want)


def test_a_restart_built_with_will_restore_copies_its_image_in_one_pass(group, tmp_path, monkeypatch):
    """A model built with ``will_restore`` has no initial values to roll back to: its image is copied into the
    weights as it is checksummed, never checksummed on its own first, and the restart holds what a restore from
    storage gives."""
    from cnr_torchrec.ckpt.memory.image import ImageFile

    root, shm = str(tmp_path / "root"), str(tmp_path / "shm")
    os.makedirs(shm)
    _job(root, shm)
    want = _storage_restore(root, shm)

    def no_separate_pass(self):
        raise AssertionError("the image was checksummed in a pass of its own")

    monkeypatch.setattr(ImageFile, "checksum", no_separate_pass)
    got, sources, stats = _restart(root, shm, seed=7, will_restore=True)
    assert [s for _, s, _ in sources] == ["memory"], sources
    assert stats["from_memory"] == 1.0
    _assert_same(got, want)


def test_a_save_that_did_not_commit_leaves_the_image_of_the_previous_checkpoint(group, tmp_path, monkeypatch):
    """The image is sealed only for what committed: a save that fails leaves it as the last commit restores."""
    from cnr_torchrec import Checkpointer
    from cnr_torchrec.ckpt.save import commit as commit_mod
    from cnr_torchrec.errors import SaveFailedError

    specs = _specs()
    root, shm = str(tmp_path / "root"), str(tmp_path / "shm")
    os.makedirs(shm)
    dmp, opt = build_dmp(specs)
    gen = torch.Generator().manual_seed(0)
    ck = Checkpointer(dmp, _config(root, shm), dense_optimizer=opt)
    for step in (1, 2):
        train(dmp, specs, opt, 2, gen)
        ck.save(step).wait()
    def refuse(*args, **kwargs):
        raise OSError("the manifest could not be written")

    monkeypatch.setattr(commit_mod, "check_manifest", refuse)  # rank 0's commit fails, after every rank wrote
    train(dmp, specs, opt, 2, gen)
    with pytest.raises(SaveFailedError):
        ck.save(3).wait()
    ck.close(keep_images=True)
    monkeypatch.undo()
    got, sources, _ = _restart(root, shm, seed=7)
    assert [s for _, s, _ in sources] == ["memory"]
    _assert_same(got, _storage_restore(root, shm))


def test_an_image_the_restore_does_not_take_is_unsealed_before_the_restore_stages_into_it(group, tmp_path,
                                                                                         monkeypatch):
    """A restore of an older checkpoint declines the image (sealed for the newest) and may stage into its rows: the
    seal goes first, so a restore that then fails leaves no seal a restart would trust; the restart reads storage."""
    from cnr_torchrec import Checkpointer
    from cnr_torchrec.ckpt.memory.tier import image_stem
    from cnr_torchrec.ckpt.restore import restorer as restorer_mod

    root, shm = str(tmp_path / "root"), str(tmp_path / "shm")
    os.makedirs(shm)
    _job(root, shm)
    seal = image_stem(shm, root, 0) + ".seal"
    assert os.path.exists(seal)

    def fail(*args, **kwargs):
        assert not os.path.exists(seal), "the restore staged into a sealed image"
        raise OSError("the storage went away")

    monkeypatch.setattr(restorer_mod, "restore_chain", fail)
    dmp, opt = build_dmp(_specs(), seed=7)
    ck = Checkpointer(dmp, _config(root, shm), dense_optimizer=opt)
    with pytest.raises(Exception, match="the storage went away"):
        ck.restore(step=2)
    ck.close(keep_images=True)
    monkeypatch.undo()
    assert not os.path.exists(seal)
    got, sources, _ = _restart(root, shm, seed=5)
    assert [s for _, s, _ in sources] == ["storage"]
    _assert_same(got, _storage_restore(root, shm))


def test_a_fold_then_a_delta_restore_from_the_image(group, tmp_path):
    """Background compaction folds the residual chain; the delta that hangs on the fold seals the image for its
    chain (the folded baseline and itself), and a restart takes it."""
    from cnr_torchrec import Checkpointer

    specs = _specs()
    root, shm = str(tmp_path / "root"), str(tmp_path / "shm")
    os.makedirs(shm)
    dmp, opt = build_dmp(specs)
    gen = torch.Generator().manual_seed(0)
    ck = Checkpointer(dmp, _config(root, shm, compaction={"max_chain": 2}), dense_optimizer=opt)
    chains = []
    for step in range(1, 7):
        train(dmp, specs, opt, 2, gen)
        chains.append(ck.save(step).wait().chain)
        ck.wait(compaction=True)
    ck.close(keep_images=True)
    assert any(len(c) >= 2 and c[0] > 0 for c in chains), chains  # a delta hung on a folded baseline
    got, sources, _ = _restart(root, shm, seed=7)
    assert [s for _, s, _ in sources] == ["memory"]
    _assert_same(got, _storage_restore(root, shm))


def test_opening_a_root_keeps_other_roots_images_and_a_clean_close_removes_its_own(group, tmp_path):
    """Each root's images lie in a directory of their own: opening a root leaves another root's (whose job may
    wait for its restart) and removes this root's of ranks the job no longer has; a clean close removes the
    rank's images and the directory, a failure keeps them."""
    from cnr_torchrec import Checkpointer
    from cnr_torchrec.ckpt.memory.tier import image_stem

    shm = str(tmp_path / "shm")
    os.makedirs(shm)
    other, root = str(tmp_path / "other"), str(tmp_path / "root")
    _job(other, shm, saves=1)
    kept = [f for f in _files(shm) if f.startswith(_image_dir(shm, other))]
    assert len(kept) == 3  # the other root's image, seal and root file
    os.makedirs(os.path.dirname(image_stem(shm, root, 3)), mode=0o700)
    beyond = image_stem(shm, root, 3) + ".img"  # this root's image of a rank the job no longer has
    open(beyond, "wb").close()
    os.chmod(beyond, 0o600)
    stranger = os.path.join(shm, "not-an-image")
    open(stranger, "wb").close()
    d = _image_dir(shm, root)
    dmp, opt = build_dmp(_specs())
    with Checkpointer(dmp, _config(root, shm), dense_optimizer=opt) as ck:
        assert _files(shm) == sorted(kept + ["not-an-image", f"{d}/r00000.img", f"{d}/root"])
        train(dmp, _specs(), opt, 1, torch.Generator().manual_seed(0))
        ck.save(1).wait()
        assert f"{d}/r00000.seal" in _files(shm)
    assert _files(shm) == sorted(kept + ["not-an-image"])  # a clean end of the job: its directory is gone too
    assert not os.path.exists(os.path.join(shm, d))

    with pytest.raises(RuntimeError, match="the job failed"):
        with Checkpointer(dmp, _config(root, shm), dense_optimizer=opt) as ck:
            ck.restore()
            raise RuntimeError("the job failed")
    assert _files(shm) == sorted(kept + ["not-an-image", f"{d}/r00000.img", f"{d}/r00000.seal", f"{d}/root"])
    _, sources, _ = _restart(other, shm, seed=7)
    assert [s for _, s, _ in sources] == ["memory"]  # the other root's job restarts from its images


def test_a_directory_without_room_means_storage_with_one_warning(group, tmp_path, monkeypatch, caplog):
    root, shm = str(tmp_path / "root"), str(tmp_path / "shm")
    os.makedirs(shm)
    real = os.statvfs

    class Full:
        def __init__(self, st):
            self.f_frsize, self.f_bavail = st.f_frsize, 0

    monkeypatch.setattr(os, "statvfs", lambda p: Full(real(p)))
    with caplog.at_level("WARNING", logger="cnr_torchrec"):
        _job(root, shm, saves=2)
    assert caplog.text.count("the memory tier is off") == 1
    assert "--shm-size" in caplog.text and "medium: Memory" in caplog.text
    assert _files(shm) == []
    monkeypatch.undo()
    _, sources, _ = _restart(root, shm, seed=7)
    assert sources[0][1] == "storage" and "not sealed" in sources[0][2]


def test_plain_coding_keeps_no_image_where_the_host_lacks_the_memory(group, tmp_path, monkeypatch, caplog):
    """With plain coding ``memory_tier: on``'s image is an extra copy: a host without the memory for it keeps none,
    on every rank, with a warning naming the need (residual coding counts it in its own check)."""
    from cnr_torchrec.ckpt import host_memory

    root, shm = str(tmp_path / "root"), str(tmp_path / "shm")
    os.makedirs(shm)
    monkeypatch.setattr(host_memory, "host_available_bytes", lambda: 1)
    with caplog.at_level("WARNING", logger="cnr_torchrec"):
        _job(root, shm, saves=2, mode="on", residual=False)
    assert "the memory tier is off" in caplog.text and "GB of images beside the job" in caplog.text
    assert _files(shm) == []


def _torchrec_worker(rank, world_size, root, shm_dirs, model):
    """TorchRec's own model on 2 ranks, residual-coded with images (one directory per rank: two "hosts")."""
    import _torchrec_models as M

    from cnr_torchrec import Checkpointer, load_config

    def config(mode="auto"):
        return load_config({"root": root, "keep_last": 10, "on_corrupt": "fail",
                            "memory_tier": {"mode": mode, "path": shm_dirs[rank]}})

    def restart(plan="A", mode="auto", seed=5):
        dmp, opt = M.build_dmp(model, plan, seed=seed)
        ck = Checkpointer(dmp, config(mode), dense_optimizer=opt)
        ck.restore()
        out = M.local_state(dmp, opt), ck.last_restore_sources
        ck.close(keep_images=True)
        return out

    dmp, opt = M.build_dmp(model, "A", seed=0)
    ck = Checkpointer(dmp, config(), dense_optimizer=opt)
    assert ck.config.quantization.residual is True  # the default config codes residuals here
    for step in (1, 2, 3):
        for s in range(2):
            M.train_step(dmp, opt, M.make_batch(model, seed=100 * rank + 10 * step + s))
        ck.save(step).wait()
    ck.close(keep_images=True)

    want, sources = restart(mode="off", seed=9)
    assert [s for _, s, _ in sources] == ["storage", "storage"]
    got, sources = restart()
    assert [s for _, s, _ in sources] == ["memory", "memory"], sources
    M.assert_same(got, want, f"rank {rank}: from memory vs from storage")

    torch.distributed.barrier()
    if rank == 1:  # its host is lost: its images are gone
        for name in os.listdir(shm_dirs[1]):
            shutil.rmtree(os.path.join(shm_dirs[1], name))
    torch.distributed.barrier()
    got, sources = restart(seed=6)
    assert [s for _, s, _ in sources] == ["memory", "storage"], sources
    M.assert_same(got, want, f"rank {rank}: a mixed restore vs from storage")

    _, sources = restart(plan="B", seed=7)  # another plan: the layout differs, no image is taken
    assert [s for _, s, _ in sources] == ["storage", "storage"], sources
    assert all("layout" in why or "not sealed" in why for _, _, why in sources), sources


@pytest.mark.multirank
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["sparse_nn", "mixed"], ids=["ebc_shared_weighted", "ec"])
def test_torchrecs_models_restore_from_images_mixed_and_never_across_plans(tmp_path, model):
    from _dist import run_ranks

    shm_dirs = [str(tmp_path / f"host{r}") for r in range(2)]
    for d in shm_dirs:
        os.makedirs(d)
    run_ranks(_torchrec_worker, 2, timeout=280, args=(str(tmp_path / "root"), shm_dirs, model))


def test_a_managed_collision_model_restores_from_its_image_as_from_storage(group, tmp_path):
    """TorchRec's managed-collision EBC (sort-zch, LFU evictions every 2 steps): the image holds each table's
    by-row state (raw ids and eviction metadata) beside its rows, and a restart from it gives what a restore
    from storage gives, slot for slot."""
    import _mc_models as M

    from cnr_torchrec import CheckNRunDMP, Checkpointer, load_config

    root, shm = str(tmp_path / "root"), str(tmp_path / "shm")
    os.makedirs(shm)

    def config(mode):
        return load_config({"root": root, "keep_last": 10, "on_corrupt": "fail",
                            "memory_tier": {"mode": mode, "path": shm}})

    def state(model):  # SGD in the tables: rows and by-row state, no optimizer state
        tracker = model.dmp.dirty_tracker
        out = {(t, i, "w"): k.tbe.split_embedding_weights()[s.local_index].detach().clone()
               for t in tracker.tables() for i, (k, s) in enumerate(tracker.shards(t))}
        out.update({("mc", t, "rows"): mc.by_row() for t, mc in tracker.mc_tables().items()})
        return out

    job = M.build_mc_model("ebc", 1, dmp_cls=CheckNRunDMP)
    ck = Checkpointer(job.dmp, config("auto"), dense_optimizer=job.dense_optimizer)
    assert ck.config.quantization.residual is True
    for step, batch in enumerate(M.mc_batches(6, 1, 0, seed=3, features=job.features), start=1):
        M.train_step(job, batch)
        if step % 2 == 0:
            ck.save(step).wait()
    ck.close(keep_images=True)

    restored = {}
    for mode in ("off", "auto"):
        model = M.build_mc_model("ebc", 1, dmp_cls=CheckNRunDMP, seed=5)
        with Checkpointer(model.dmp, config(mode), dense_optimizer=model.dense_optimizer) as other:
            assert other.restore() == 6
            restored[mode] = (state(model), [s for _, s, _ in other.last_restore_sources])
            other.close(keep_images=True)
    assert restored["off"][1] == ["storage"] and restored["auto"][1] == ["memory"]
    assert any(k[0] == "mc" for k in restored["off"][0] if isinstance(k, tuple))
    _assert_same(restored["auto"][0], restored["off"][0])
