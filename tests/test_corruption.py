"""Damaged and untrusted checkpoints: every corruption is found and named, nothing unsafe is loaded.

The corruption matrix (benchmarks/reliability.py, ``corruption_matrix``) flips one byte at
several positions of, and separately truncates, every file of two checkpoints (the
newest, and the baseline its chain starts from) and index.json, then restores on 2 gloo
ranks under ``on_corrupt: fail`` and ``fallback`` and runs ``verify_root``. The other
tests craft checkpoints a job would never write: another model's, re-sealed manifests
naming paths outside the root or a dtype we never write, a pickle smuggled into a
payload, another world size with per-rank state.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import reliability as R  # noqa: E402

pytestmark = pytest.mark.multirank


# ---- the matrix --------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_every_corruption_is_detected_and_named(tmp_path):
    from cnr_torchrec.ckpt.tools import verify  # noqa: F401  (the matrix checks verify_root too; it must exist)

    per_rank = R.run_ranks(R.corruption_matrix, 2, (str(tmp_path), 3), timeout=200)
    s = R.summarize_corruption(per_rank)
    cases = per_rank[0]["cases"]
    files = {c["file"] for c in cases}
    assert files == {f"ckpt-{i:08d}/{f}" for i in (2, 4) for f in ("manifest.json", "rank-00000.bin",
                                                                    "rank-00001.bin")} | {"index.json"}
    assert {c["how"].split("@")[0] for c in cases} == {"flip", "truncate"}
    assert s["verify_available"]
    handled = s["corruptions_detected"] + s["corruptions_read_around"]
    assert handled == s["corruptions_injected"] == len(cases), json.dumps(s["misses"][:3], indent=1)
    # Restore reads only the rows it applies: a flip in a baseline row that a delta supersedes is read around
    # (the restore is exact and verify_root names the file); a flip in a row it applies is caught.
    assert s["corruptions_read_around"] > 0 and s["corruptions_detected"] > 0, s
    for rank_view in per_rank:
        for c in rank_view["cases"]:
            assert c["detected"] == {"fail": True, "fallback": True}, c
    for c in cases:
        assert c["unchanged"], c  # restore never wrote or deleted anything under the root
        assert c["verify"], c  # verify_root named the damaged file
    # A payload byte only rank 1 reads: rank 0 had applied the whole chain before the ranks compared
    # outcomes; the fallback to an older chain still restored it exactly.
    assert s["fallbacks_after_partial_apply"] > 0


# ---- untrusted checkpoints ---------------------------------------------------------


class Counter:
    """A per-rank Stateful (like a data loader's position)."""

    def __init__(self, n: int) -> None:
        self.n = torch.tensor([n])

    def state_dict(self):
        return {"n": self.n.clone()}

    def load_state_dict(self, sd):
        self.n = sd["n"].clone()


def _other_model(world_size, extra_table: bool):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.types import ShardingEnv

    from cnr_torchrec import CheckNRunDMP
    from examples.toy import TableSpec, ToyModel, build_plan, sharders_for

    specs = [TableSpec(t, R.ROWS[t], 16 if (t == "t1" and not extra_table) else R.DIM, R.SHARDING[t]) for t in R.ROWS]
    if extra_table:
        specs.append(TableSpec("t3", 64, R.DIM, "row_wise"))
    model = ToyModel(specs)
    sharders = sharders_for(EmbOptimType.EXACT_ROWWISE_ADAGRAD, lr=0.05)
    dmp = CheckNRunDMP(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                       plan=build_plan(model, sharders, world_size), sharders=sharders)
    return dmp, torch.optim.Adam([p for n, p in dmp.named_parameters() if n.startswith("dense")], lr=0.01)


def _edit_manifest(root: str, ckpt_id: int, edit) -> None:
    """Edits a manifest's body and re-seals it, as someone crafting a checkpoint would."""
    from _format_checks import read_combined_at, write_combined_at

    from cnr_torchrec.ckpt.format.commits import manifest_path

    path = os.path.join(root, manifest_path(ckpt_id))
    body = read_combined_at(path)  # the ranks' parts as one body
    edit(body)
    write_combined_at(path, body)


def _recompute_row_crcs(manifest: str, rank: int, data: bytearray) -> None:
    """Rewrites, in ``data`` (rank ``rank``'s payload), every entry's CRC-32Cs (one per group of rows) to match
    its rows, as someone crafting a checkpoint would (google-crc32c computes them)."""
    import google_crc32c

    from _format_checks import read_combined_at

    report = read_combined_at(manifest)["ranks"][rank]
    blobs = report["blobs"]
    for entries in report["tables"].values():
        for e in entries:
            names = [e["weights"]["blobs"][k] for k in sorted(e["weights"]["blobs"])] + [s["blob"] for s in e["states"]]
            n, group = blobs[names[0]]["shape"][0], e["checks"]["rows"]

            def rows(b, i, j):  # rows i..j of blob b
                width = blobs[b]["nbytes"] // n
                return bytes(data[blobs[b]["offset"] + i * width : blobs[b]["offset"] + j * width])

            crcs = [google_crc32c.value(b"".join(rows(b, g, min(n, g + group)) for b in names))
                    for g in range(0, n, group)]
            at = blobs[e["checks"]["blob"]]["offset"]
            data[at : at + 4 * len(crcs)] = torch.tensor(crcs, dtype=torch.int64).to(torch.int32).numpy().tobytes()


def _untrusted_worker(rank, world_size, work):
    from cnr_torchrec import (
        Checkpointer,
        CheckpointNotFoundError,
        CorruptCheckpointError,
        IncompatibleCheckpointError,
        RestoreFailedError,
        UnsafeCheckpointError,
    )

    out: dict[str, object] = {}
    base = os.path.join(work, "base")
    dmp, specs, opt = R.build(world_size)
    counter = Counter(10 + rank)
    gen = torch.Generator().manual_seed(rank)
    ckpt = Checkpointer(dmp, R.make_config(base, "consecutive", "none", None), dense_optimizer=opt,
                        extra_state={"c": counter})
    for step in (1, 2):
        R.train(dmp, specs, opt, 2, gen)
        ckpt.save(step).wait()
    ckpt.close()
    live = R.local_state(dmp, opt)

    def fresh_copy(name: str) -> str:
        root = os.path.join(work, name)
        if rank == 0:
            shutil.copytree(base, root)
        dist.barrier()
        return root

    def attempt(name, root, want, match="", model=(dmp, opt), mode="fallback", before_apply=True, **restore_kw):
        """Restores into a scrambled ``model``; records whether ``want`` was raised (and, if ``before_apply``,
        whether the model was left alone: refused before anything was applied)."""
        m, o = model
        R.scramble(m, o, seed=len(out))
        before = R.local_state(m, o)
        c = Checkpointer(m, R.make_config(root, "consecutive", "none", None, on_corrupt=mode), dense_optimizer=o,
                         extra_state={"c": counter} if m is dmp else None)
        try:
            c.restore(**restore_kw)
            got = None
        except Exception as e:  # noqa: BLE001
            got = e
        c.close()
        untouched = not R.compare(R.local_state(m, o), before, None)
        ok = isinstance(got, want) and match in str(got) and (untouched or not before_apply)
        out[name] = ok if ok else f"{type(got).__name__}: {got} (untouched: {untouched})"
        return got

    # Another model: an extra table, or a table of another width.
    for extra in (True, False):
        other = _other_model(world_size, extra)
        attempt(f"other model ({'extra table' if extra else 'other shape'})", base, IncompatibleCheckpointError,
                "t3" if extra else "'t1' is 160 x 16 in the model but 160 x 8", model=other)

    # A root that does not exist: named error, and the root is not created by looking.
    missing = os.path.join(work, "no-such-root")
    attempt("missing root", missing, CheckpointNotFoundError, "no complete checkpoint")
    out["missing root not created"] = not os.path.exists(missing)

    # Re-sealed manifests naming files outside the checkpoint: refused under both settings, never skipped.
    for n, bad in enumerate(("../x.bin", "/etc/passwd", "ckpt-00000000/rank-00001.bin", "ckpt-00000001/../../x.bin")):
        root = fresh_copy(f"unsafe-{n}")
        if rank == 0:
            _edit_manifest(root, 1, lambda body, bad=bad: body["ranks"][1].update(file=bad))
        dist.barrier()
        for mode in ("fail", "fallback"):
            attempt(f"unsafe path {bad!r} ({mode})", root, UnsafeCheckpointError, "refusing", mode=mode)

    # A blob of a dtype we never write (what a pickled object would need): refused before any read.
    root = fresh_copy("dtype")
    if rank == 0:
        def to_object(body):
            name = next(iter(body["ranks"][0]["blobs"]))
            body["ranks"][0]["blobs"][name]["dtype"] = "object"
        _edit_manifest(root, 0, to_object)
    dist.barrier()
    attempt("dtype 'object'", root, UnsafeCheckpointError, "'object', which is never written")

    # A pickle smuggled into a payload, with every checksum recomputed: its bytes are read as raw
    # float32 values; nothing is unpickled (the pickle would create a file if it were).
    marker = os.path.join(work, "unpickled")
    root = fresh_copy("pickle")
    if rank == 0:
        from cnr_torchrec.ckpt.format.bytes.payload import checksum

        class Trap:
            def __reduce__(self):
                return (open, (marker, "w"))

        smuggled = pickle.dumps({"weights": Trap()})
        file = os.path.join(root, "ckpt-00000000", "rank-00000.bin")
        with open(file, "rb") as f:
            data = bytearray(f.read())
        data[: len(smuggled)] = smuggled
        _recompute_row_crcs(os.path.join(root, "ckpt-00000000", "manifest.json"), 0, data)
        with open(file, "wb") as f:
            f.write(data)

        def reseal(body):
            r0 = body["ranks"][0]
            r0["chunks"][0]["xxh3"] = checksum(bytes(data))  # one chunk: the toy payload is far below chunk_bytes
            for meta in r0["blobs"].values():
                meta["xxh3"] = checksum(bytes(data[meta["offset"] : meta["offset"] + meta["nbytes"]]))
        _edit_manifest(root, 0, reseal)
    dist.barrier()
    from unittest import mock

    guards = [mock.patch.object(torch, "load", side_effect=AssertionError("torch.load on a payload")),
              mock.patch.object(pickle, "load", side_effect=AssertionError("pickle.load")),
              mock.patch.object(pickle, "loads", side_effect=AssertionError("pickle.loads")),
              mock.patch.object(pickle, "Unpickler", side_effect=AssertionError("pickle.Unpickler"))]
    for g in guards:
        g.start()
    try:
        c = Checkpointer(dmp, R.make_config(root, "consecutive", "none", None), dense_optimizer=opt,
                         extra_state={"c": counter})
        try:
            out["pickle in a payload is read as raw bytes"] = c.restore(step=1) == 1
        except Exception as e:  # noqa: BLE001
            out["pickle in a payload is read as raw bytes"] = f"{type(e).__name__}: {e}"
        c.close()
        # And a sound checkpoint restores exactly with torch.load and pickle unusable.
        R.scramble(dmp, opt, seed=99)
        c = Checkpointer(dmp, R.make_config(base, "consecutive", "none", None), dense_optimizer=opt,
                         extra_state={"c": counter})
        out["restore without torch.load or pickle"] = c.restore() == 2 and not R.compare(R.local_state(dmp, opt),
                                                                                          live, None)
        c.close()
    finally:
        for g in guards:
            g.stop()
    out["the smuggled pickle never ran"] = not os.path.exists(marker)

    # Every chain needs a damaged baseline: fallback has nothing left and says what it skipped.
    root = fresh_copy("no-sound-chain")
    if rank == 0:
        with open(os.path.join(root, "ckpt-00000000", "rank-00001.bin"), "r+b") as f:
            f.seek(17)
            b = f.read(1)
            f.seek(17)
            f.write(bytes([b[0] ^ 0xFF]))
    dist.barrier()
    # Payload damage is found while applying, after rank 0 (or both) wrote rows: each rank puts back what it
    # overwrote, so the model is as it was. Checkpoints exist: not CheckpointNotFoundError, never a fresh start.
    attempt_err = attempt("no sound chain (fallback)", root, RestoreFailedError, "ckpt-00000000/rank-00001.bin")
    out["no sound chain lists what was skipped"] = (not isinstance(attempt_err, CheckpointNotFoundError)
                                                    and 0 in getattr(attempt_err, "skipped", {}))
    err = attempt("no sound chain (fail)", root, CorruptCheckpointError, "ckpt-00000000/rank-00001.bin", mode="fail")
    out["fail names the file in .path"] = getattr(err, "path", None) == "ckpt-00000000/rank-00001.bin"
    return out


@pytest.mark.timeout(240)
def test_untrusted_checkpoints_fail_with_named_errors(tmp_path):
    per_rank = R.run_ranks(_untrusted_worker, 2, (str(tmp_path),), timeout=200)
    for rank, out in enumerate(per_rank):
        bad = {k: v for k, v in out.items() if v is not True}
        assert not bad, (rank, bad)
    assert len(per_rank[0]) == 20


# ---- another world size ------------------------------------------------------------


def _world_size_worker(rank, world_size, root, phase):
    from cnr_torchrec import Checkpointer, IncompatibleCheckpointError

    dmp, specs, opt = R.build(world_size, seed=3 if phase == "restore" else 0)
    counter = Counter(100 + rank)
    config = R.make_config(root, "consecutive", "none", None)
    if phase == "save":
        ckpt = Checkpointer(dmp, config, dense_optimizer=opt, extra_state={"c": counter})
        R.train(dmp, specs, opt, 2, torch.Generator().manual_seed(rank))
        ckpt.save(7).wait()
        ckpt.close()
        return {}
    out: dict[str, object] = {}
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("cnr_torchrec").addHandler(handler)
    before = R.local_state(dmp, opt)
    ckpt = Checkpointer(dmp, config, dense_optimizer=opt, extra_state={"c": counter})
    try:
        ckpt.restore()
        out["strict refuses per-rank state"] = "restored"
    except IncompatibleCheckpointError as e:
        out["strict refuses per-rank state"] = ("per_rank_state='drop'" in str(e) and "['c']" in str(e)
                                                or str(e))
    out["model untouched by the refusal"] = not R.compare(R.local_state(dmp, opt), before, None)
    out["drop restores the rest"] = ckpt.restore(per_rank_state="drop") == 7
    out["drop leaves per-rank state alone"] = int(counter.n) == 100 + rank
    out["drop is logged"] = any("per-rank state" in w and "not restored" in w for w in warnings)
    out["model restored"] = bool(R.compare(R.local_state(dmp, opt), before, None))
    ckpt.close()
    plain = Checkpointer(dmp, config, dense_optimizer=opt)
    out["no extra_state: restores, RNG dropped with a warning"] = plain.restore() == 7
    plain.close()
    return out


@pytest.mark.timeout(240)
def test_per_rank_state_onto_another_world_size(tmp_path):
    root = str(tmp_path / "root")
    R.run_ranks(_world_size_worker, 2, (root, "save"), timeout=120)
    (out,) = R.run_ranks(_world_size_worker, 1, (root, "restore"), timeout=120)
    assert all(v is True for v in out.values()), out
    assert len(out) == 7
