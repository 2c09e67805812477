"""Crafted checkpoints whose every field is well typed and whose checksums agree, but which do not hang together.

A checksum is not a MAC: anyone who can write a root can re-seal what they change, exactly as the writer
seals (each part's size and xxh3 in its index line, the index's xxh3 over its body). Each case below edits a
real chain of TorchRec's sharded toy model (every sharding type, residual coding) written by 1 and by 2 ranks,
re-seals it, and then:

- ``cnr verify`` must exit 1 (or 2), with no traceback;
- a restore onto 1 rank and onto 2 ranks must raise a named error (corrupt, unsafe, incompatible) or
  restore exactly what the untouched chain restores on that world size.

The untouched chains verify and restore on both world sizes (so none of the checks refuses what the writer
writes).
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch
from _dist import run_ranks
from _format_checks import combined_body, write_combined, xxh3_reference
from _toy import Reader as _Reader
from _toy import build_dmp, local_state, train

PLAN = ("table_wise", "row_wise", "column_wise", "data_parallel")
BASELINE, DELTA = 0, 1


def _specs():
    from examples.toy import TableSpec

    return [TableSpec(f"t{i}", 120, 8, st, "ebc") for i, st in enumerate(PLAN)]


def _checkpointer(dmp, opt, root, reader):
    from cnr_torchrec import Checkpointer, load_config

    cfg = load_config({"root": root, "policy": "consecutive", "on_corrupt": "fail", "memory_tier": "off",
                       "quantization": {"bits": 4}})
    return Checkpointer(dmp, cfg, dense_optimizer=opt, extra_state={"reader": reader})


def _write_chain(rank, world_size, root):
    """A baseline and a residual delta of a seeded run; each rank's per-rank state (a data reader's position)
    is its own."""
    dmp, opt = build_dmp(_specs(), seed=0)
    gen = torch.Generator().manual_seed(rank)
    reader = _Reader()
    reader.pos.fill_(7 + rank)
    with _checkpointer(dmp, opt, root, reader) as ck:
        for step in (1, 2):
            train(dmp, _specs(), opt, 2, gen)
            ck.save(step).wait()


def _scramble(dmp):
    """Every weight and optimizer state a restore sets, overwritten, so that rows it leaves alone show."""
    with torch.no_grad():
        for p in dmp.parameters():
            p.fill_(0.25)
        for t in dmp.dirty_tracker.tables():
            for k, s in dmp.dirty_tracker.shards(t):
                k.tbe.split_embedding_weights()[s.local_index].fill_(0.25)


def _outcome(dmp, opt, root, world_size, written_by):
    """('named', error) or ('restored', state) of restoring ``root`` into ``dmp``, from scrambled weights."""
    from cnr_torchrec.errors import CorruptCheckpointError, IncompatibleCheckpointError, UnsafeCheckpointError

    _scramble(dmp)
    reader = _Reader()
    reader.pos.fill_(-1)
    ck = _checkpointer(dmp, opt, root, reader)
    try:
        ck.restore(per_rank_state="strict" if world_size == written_by else "drop")
    except (CorruptCheckpointError, UnsafeCheckpointError, IncompatibleCheckpointError) as e:
        return "named", f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - the point of the test
        return "other", f"{type(e).__name__}: {e}"
    finally:
        ck.close()
    return "restored", {**local_state(dmp), "reader": reader.pos.clone()}


def _judge(outcome, want):
    """None if the outcome is a named error or the untouched chain's restore; else what is wrong."""
    kind, got = outcome
    if kind == "named":
        return None if "This is a bug" not in got else got
    if kind == "other":
        return got
    bad = sorted(str(k) for k in want if not torch.equal(got[k], want[k]))
    return f"restored other values without an error ({bad[:4]})" if bad else None


def _restore_all(rank, world_size, roots, written_by, out):
    """On each rank: the untouched chain's restore, then each crafted root's outcome judged against it."""
    dmp, opt = build_dmp(_specs(), seed=1)
    kind, want = _outcome(dmp, opt, roots["untouched"], world_size, written_by[roots["untouched"]])
    assert kind == "restored", want
    verdicts = {name: _judge(_outcome(dmp, opt, root, world_size, written_by[root]), want)
                for name, root in roots.items() if name != "untouched"}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(verdicts, f)


# ---------------------------------------------------------------------- re-sealing as the writer seals


def _storage(root):
    from cnr_torchrec.ckpt.format.bytes.storage import Storage

    return Storage(root)


def _edit_parts(root, ckpt_id, edit):
    """``edit(body)`` on the checkpoint's index with its parts as ``ranks`` (format/tests' combined body), then
    each part and the index re-sealed, the index's lines saying the rows each part now holds."""
    storage = _storage(root)
    try:
        body = combined_body(storage, ckpt_id)
        edit(body)
        write_combined(storage, ckpt_id, body)
    finally:
        storage.close()

    def lines(index):
        for line, part in zip(index["parts"], body["ranks"]):
            line["rows_written"] = part["rows_written"]

    _edit_index(root, ckpt_id, lines)


def _seal_text(text: bytes) -> bytes:
    """A sealed index around body ``text``, sealed as the writer seals: its xxh3 (XXH3-128, the reference
    library's) over the body's bytes."""
    from cnr_torchrec.ckpt.format.commits import FORMAT, VERSION

    head = json.dumps({"format": FORMAT, "version": VERSION, "xxh3": xxh3_reference(text)}).encode()
    return head[:-1] + b', "body": ' + text + b"}"


def _index_path(root, ckpt_id):
    return os.path.join(root, f"ckpt-{ckpt_id:08d}", "manifest.json")


def _index_body(root, ckpt_id):
    return json.loads(open(_index_path(root, ckpt_id), "rb").read())["body"]


def _edit_index(root, ckpt_id, edit):
    """``edit(body)`` on the index alone (its lines as written), re-sealed."""
    body = _index_body(root, ckpt_id)
    edit(body)
    _write_index_text(root, ckpt_id, json.dumps(body, separators=(",", ":")).encode())


def _write_index_text(root, ckpt_id, text):
    with open(_index_path(root, ckpt_id), "wb") as f:
        f.write(_seal_text(text))


def _edit_part_text(root, ckpt_id, rank, edit):
    """``edit(text)`` on rank ``rank``'s part's bytes; its line's size and xxh3 made to match, the index re-sealed."""
    path = os.path.join(root, f"ckpt-{ckpt_id:08d}", f"rank-{rank:05d}.json")
    data = edit(open(path, "rb").read())
    with open(path, "wb") as f:
        f.write(data)

    def line(body):
        body["parts"][rank].update(nbytes=len(data), xxh3=xxh3_reference(data))

    _edit_index(root, ckpt_id, line)


def _entries(body, rank, table):
    return body["ranks"][rank]["tables"][table]


def _stored(entry):
    return entry["ids"]["count"] if "ids" in entry else entry["rows"][1] - entry["rows"][0]


# ---------------------------------------------------------------------- the cases


def _shards(root):
    def edit(body):
        layout = body["shards"]["t2"]  # column_wise: its boxes, by rank
        body["shards"]["t2"] = [[1 - b[0], *b[1:]] for b in layout]

    _edit_index(root, DELTA, edit)


def _layout(root):
    def edit(body):
        body["parts"][0]["layout"] = "0" * 16

    _edit_index(root, DELTA, edit)


def _deep_json_part(root, depth=5000):
    _edit_part_text(root, DELTA, 0, lambda t: t.replace(b'"extra":{', b'"extra":{"deep":' + b"[" * depth +
                                                        b"]" * depth + b",", 1))


def _nested_tree_part(root):
    _deep_json_part(root, depth=200)


def _deep_json_index(root):
    body = json.dumps(_index_body(root, DELTA), separators=(",", ":")).encode()
    _write_index_text(root, DELTA, body.replace(b'"codec":{', b'"codec":{"deep":' + b"[" * 5000 + b"]" * 5000 + b",",
                                                1))


def _huge_int_part(root):
    def edit(text):
        doc = json.loads(text)
        return text.replace(f'"tbe_iter":{doc["tbe_iter"]}'.encode(), b'"tbe_iter":' + b"9" * 5000, 1)

    _edit_part_text(root, DELTA, 0, edit)


def _huge_int_index(root):
    body = json.dumps(_index_body(root, DELTA), separators=(",", ":")).encode()
    restores = json.loads(body)["restores"]
    _write_index_text(root, DELTA, body.replace(f'"restores":{restores}'.encode(), b'"restores":' + b"7" * 5000, 1))


def _twice(root):
    def edit(body):
        part = body["ranks"][0]
        table, entry = next((t, e) for t, es in part["tables"].items() for e in es if e.get("residual") and _stored(e))
        part["tables"][table].append(copy.deepcopy(entry))
        part["rows_written"] += _stored(entry)
        part["residual_entries"] += 1
        if "whole" in entry:
            part["whole_rows"] += entry["whole"]["count"]

    _edit_parts(root, DELTA, edit)


def _onto_other_rows(root):
    def edit(body):
        entry = _entries(body, 1, "t1")[0]  # row_wise: rank 1's rows moved onto rank 0's
        span = entry["rows"][1] - entry["rows"][0]
        entry["rows"] = [0, span]

    _edit_parts(root, DELTA, edit)


def _onto_other_cols(root):
    def edit(body):
        entry = _entries(body, 1, "t2")[0]  # column_wise: rank 1's columns moved onto rank 0's
        width = entry["cols"][1] - entry["cols"][0]
        entry["cols"] = [0, width]

    _edit_parts(root, DELTA, edit)


def _baseline_without_a_table(root):
    def edit(body):
        for part in body["ranks"]:
            part["rows_written"] -= sum(_stored(e) for e in part["tables"].pop("t1", []))

    _edit_parts(root, BASELINE, edit)


def _replicated_not_stored(root):
    def edit(body):
        for part in body["ranks"]:
            part["replicated_tables"].pop("t3", None)  # data_parallel: the index still lists it replicated

    _edit_parts(root, DELTA, edit)


def _equals_on_a_delta(root):
    _edit_index(root, DELTA, lambda body: body.update(equals=BASELINE))


def _per_rank_state_false(root):
    _edit_index(root, DELTA, lambda body: body.update(per_rank_state=False))


def _part_in_another_slot(root):
    def edit(body):
        body["parts"][1] = dict(body["parts"][0])

    src = os.path.join(root, f"ckpt-{DELTA:08d}", "rank-00000.json")
    shutil.copyfile(src, os.path.join(root, f"ckpt-{DELTA:08d}", "rank-00001.json"))
    _edit_index(root, DELTA, edit)


def _dense_blob_elsewhere(root):
    def edit(body):
        part = body["ranks"][0]
        name = next(iter(part["dense"].values()))
        blob = part["blobs"][name]
        other = next(b for n, b in part["blobs"].items() if n != name and b["nbytes"] >= blob["nbytes"])
        blob["offset"] = other["offset"]  # inside the same payload, past no end: only the blob's xxh3 can tell

    _edit_parts(root, DELTA, edit)


CASES = {
    "shards": (_shards, 2), "layout": (_layout, None), "deep JSON in a part": (_deep_json_part, None),
    "a state tree nested 200 deep": (_nested_tree_part, None), "deep JSON in an index": (_deep_json_index, None),
    "a 5000-digit integer in a part": (_huge_int_part, None),
    "a 5000-digit integer in an index": (_huge_int_index, None),
    "an entry twice": (_twice, None), "an entry on another rank's rows": (_onto_other_rows, 2),
    "an entry on another rank's columns": (_onto_other_cols, 2),
    "a baseline without a table": (_baseline_without_a_table, None),
    "replicated without a stored copy": (_replicated_not_stored, None),
    "equals on a delta": (_equals_on_a_delta, None), "per_rank_state false": (_per_rank_state_false, None),
    "a part in another rank's slot": (_part_in_another_slot, 2),
    "a dense blob's offset elsewhere": (_dense_blob_elsewhere, None),
}
"""name -> (craft(root), the world size whose chain it needs: None for both)."""


@pytest.fixture(scope="module")
def crafted(tmp_path_factory):
    """The chains written by 1 and 2 ranks, untouched, and every case crafted from a copy of each:
    {world size: {case: root}}."""
    base = tmp_path_factory.mktemp("crafted")
    roots: dict[int, dict[str, str]] = {}
    for ws in (1, 2):
        untouched = str(base / f"w{ws}-untouched")
        run_ranks(_write_chain, ws, args=(untouched,))
        roots[ws] = {"untouched": untouched}
        for name, (craft, needs) in CASES.items():
            if needs not in (None, ws):
                continue
            root = str(base / f"w{ws}-{name.replace(' ', '-')}")
            shutil.copytree(untouched, root)
            craft(root)
            roots[ws][name] = root
    return roots


def test_cnr_verify_refuses_every_crafted_root_without_a_traceback(crafted, capsys):
    from cnr_torchrec.cli import main

    for ws, roots in crafted.items():
        assert main(["verify", roots["untouched"]]) == 0, capsys.readouterr().out
        for name, root in roots.items():
            if name == "untouched":
                continue
            code = main(["verify", root])
            out = capsys.readouterr()
            assert code in (1, 2), f"{name} (written by {ws}): verify exits {code}: {out.out}"
            assert "Traceback" not in out.out + out.err, name


@pytest.mark.parametrize("onto", [1, 2])
def test_every_crafted_root_is_refused_by_name_or_restores_as_written(crafted, tmp_path, onto):
    """Onto 1 rank and onto 2, from the chains of 1 and of 2 ranks."""
    problems = []
    for ws, roots in crafted.items():
        written_by = {root: ws for root in roots.values()}
        out = str(tmp_path / f"verdicts-{ws}")
        run_ranks(_restore_all, onto, args=(roots, written_by, out), timeout=600)
        for rank in range(onto):
            verdicts = json.load(open(f"{out}.{rank}"))
            assert set(verdicts) == set(roots) - {"untouched"}
            problems += [f"{name}, written by {ws}, onto {onto} (rank {rank}): {v}"
                         for name, v in verdicts.items() if v]
    assert not problems, "\n".join(problems)


def _fallback_restore(rank, world_size, root, out):
    from cnr_torchrec import Checkpointer, load_config

    dmp, opt = build_dmp(_specs(), seed=1)
    cfg = load_config({"root": root, "policy": "consecutive", "on_corrupt": "fallback", "memory_tier": "off"})
    with Checkpointer(dmp, cfg, dense_optimizer=opt, extra_state={"reader": _Reader()}) as ck:
        step = ck.restore()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(step, f)


def test_a_part_of_another_checkpoint_is_corrupt_and_on_corrupt_fallback_takes_the_one_before(crafted, tmp_path):
    """The delta's part replaced by the baseline's (its line made to match): refused as corrupt, not as unsafe,
    so that ``on_corrupt: fallback`` restores the baseline instead of stopping."""
    root = str(tmp_path / "root")
    shutil.copytree(crafted[2]["untouched"], root)
    base_part = os.path.join(root, f"ckpt-{BASELINE:08d}", "rank-00001.json")  # read by rank 1 alone, as it applies
    _edit_part_text(root, DELTA, 1, lambda _: open(base_part, "rb").read())
    _edit_index(root, DELTA, lambda body: body["parts"][1].update(
        {k: v for k, v in _index_body(root, BASELINE)["parts"][1].items() if k not in ("nbytes", "xxh3")}))
    out = str(tmp_path / "step")
    run_ranks(_fallback_restore, 2, args=(root, out))
    assert json.load(open(out)) == 1  # the baseline's step
