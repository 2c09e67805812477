"""Crafted manifests: every field of a real manifest mutated, re-sealed, and restored.

The seal is a checksum, so a crafted manifest with a valid xxh3 reaches the parser. For
every kind of field of a real delta's manifest (each key path, with list positions and blob
and table names folded together) and several mutations of it, the re-sealed manifest must
either be refused with a named error (CorruptCheckpointError / UnsafeCheckpointError naming
the manifest) before the restore changes anything it should not, or restore exactly what the
untouched manifest restores (the field is informational). Never another exception, never
other values.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re

import pytest
import torch

from _format_checks import combined_body, put_back, read_combined_at, snapshot_dir, write_combined_at
from _toy import Reader as _Reader
from _toy import build_dmp, local_state, train

PLAN = ("table_wise", "row_wise", "column_wise", "data_parallel")


def _checkpointer(root, seed):
    from cnr_torchrec import Checkpointer, load_config
    from examples.toy import TableSpec

    specs = [TableSpec(f"t{i}", 120, 8, st, "ebc") for i, st in enumerate(PLAN)]
    dmp, opt = build_dmp(specs, seed=seed)
    cfg = load_config({"root": root, "policy": "consecutive", "on_corrupt": "fail",
                       "quantization": {"method": "adaptive", "bits": 4}})
    return Checkpointer(dmp, cfg, dense_optimizer=opt, extra_state={"reader": _Reader()}), dmp, specs, opt


def _pattern(path: tuple) -> str:
    """A field's kind: list positions, blob names and table names folded."""
    out = []
    for i, key in enumerate(path):
        parent = path[i - 1] if i else None
        if isinstance(key, int):
            out.append("[i]")
        elif parent in ("blobs", "tables", "replicated_tables", "dense", "encodings", "table_fqns", "table_shapes",
                        "extra"):
            out.append("[*]")
        else:
            out.append(f".{key}")
    return "".join(out)


def _fields(tree, path=()):
    """(path, value) of every member of a JSON tree, containers included, first of each kind."""
    seen = set()

    def walk(node, path):
        if path and _pattern(path) not in seen:
            seen.add(_pattern(path))
            yield path, node
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            yield from walk(v, path + (k,))

    return list(walk(tree, path))


def _mutations(value):
    """Ways to break a field: another type, out of range, reversed, huge, gone."""
    out = [("deleted", None), ("a string", "x"), ("null", None), ("negative", -1), ("huge", 10**12)]
    if isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value):
        out += [("reversed", value[::-1]), ("past its end", [value[0], value[1] + 10**9])]
    if isinstance(value, bool):
        out.append(("flipped", not value))
    if isinstance(value, dict):
        out.append(("with an unknown key", {**value, "zzz": 1}))
    return out


def _set(body, path, how, value):
    node = body
    for key in path[:-1]:
        node = node[key]
    if how == "deleted":
        del node[path[-1]]
    else:
        node[path[-1]] = value


def _same(a, b) -> bool:
    """Equal tensors (shape and values), or equal values."""
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b


def crafted_outcomes(body, path, restore, state, want, fields, write=None):
    """Each of ``fields`` of manifest ``body`` (its ranks' parts as one body, :func:`combined_body`) mutated every
    way, written back at ``path`` with every checksum over it recomputed (``write(mutated)``; by default each
    rank's part and the index, :func:`write_combined_at`) and restored (``restore()`` returns the step): counts of
    named refusals and identical restores, and the problems (another exception, an error that names no file, other
    values than ``want``, as ``state()`` reads them). Leaves the checkpoint mutated."""
    from cnr_torchrec.errors import CorruptCheckpointError, IncompatibleCheckpointError, UnsafeCheckpointError

    write = write or (lambda mutated: write_combined_at(path, mutated))

    outcomes, problems = {"named": 0, "identical": 0}, []
    for field, value in fields:
        for how, new in _mutations(value):
            mutated = copy.deepcopy(body)
            _set(mutated, field, how, new)
            write(mutated)
            name = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in field)
            try:
                got_step = restore()
            except (CorruptCheckpointError, UnsafeCheckpointError, IncompatibleCheckpointError) as e:
                outcomes["named"] += 1
                if not re.search(r"ckpt-\d{8}/(manifest.json|rank-)|checkpoint \d+\b", str(e)):
                    problems.append(f"{name} {how}: the error names no file: {e}")
                continue
            except Exception as e:  # noqa: BLE001 - the point of the test
                problems.append(f"{name} {how}: {type(e).__name__}: {e}")
                continue
            got = state()
            if got_step != mutated["step"] or any(not _same(got.get(k), want[k]) for k in want):
                problems.append(f"{name} {how}: restored other values without an error")
            else:
                outcomes["identical"] += 1
    return outcomes, problems


def _delta_manifest(root):
    """A baseline and a delta of the toy model under ``root``. Returns the delta's manifest path and its
    checkpoint's files (:func:`snapshot_dir`)."""
    from cnr_torchrec.ckpt.format.commits import manifest_path

    ck, dmp, specs, opt = _checkpointer(root, 0)
    gen = torch.Generator().manual_seed(0)
    for step in (1, 2):
        train(dmp, specs, opt, 2, gen)
        info = ck.save(step).wait()
    ck.close()
    path = os.path.join(root, manifest_path(info.id))
    return path, snapshot_dir(path)


@pytest.mark.timeout(600)
def test_every_field_of_a_crafted_manifest_is_refused_by_name_or_harmless(group, tmp_path):
    """Every field of a delta's parts (as one body) and of its index's lines, each mutated every way."""
    from cnr_torchrec.ckpt.format.commits import seal

    root = str(tmp_path / "root")
    path, files = _delta_manifest(root)
    body = read_combined_at(path)
    index = json.loads(files[path])["body"]
    assert body["kind"] == "delta" and any("ids" in e for r in body["ranks"] for es in r["tables"].values()
                                           for e in es)

    restorer, fresh, _, _ = _checkpointer(root, 1)
    assert restorer.restore() == 2
    want = local_state(fresh)

    outcomes, problems = crafted_outcomes(body, path, restorer.restore, lambda: local_state(fresh), want,
                                          _fields(body))
    put_back(files)

    def write_index(mutated):
        with open(path, "wb") as f:
            f.write(seal(mutated))

    lines = [fv for fv in _fields(index) if fv[0][0] in ("parts", "shards")]
    more, problems_index = crafted_outcomes(index, path, restorer.restore, lambda: local_state(fresh), want, lines,
                                            write_index)
    put_back(files)
    problems += problems_index
    outcomes = {k: outcomes[k] + more[k] for k in outcomes}
    print(f"mutations: {outcomes}; of the index's lines: {more}")  # shown with -s
    assert not problems, "\n".join(problems[:15])
    assert outcomes["named"] > 200 and outcomes["identical"] > 20, outcomes  # both kinds of field are covered


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", [
    "an entry whose row range runs past its table",
    "an entry shifted whole past its table",  # only the entry-inside-its-table bound catches it
    "a blob shape that does not match its bytes",
    "a reversed row range",
    "negative columns",
])
def test_the_crafted_manifests_of_the_issue_are_refused_before_any_allocation(group, tmp_path, how):
    """Each crafted manifest breaks one check, and the error names that check's field in full."""
    from cnr_torchrec.ckpt.format.commits import manifest_path, part_path
    from cnr_torchrec.ckpt.tools.verify import verify_root
    from cnr_torchrec.errors import CorruptCheckpointError

    root = str(tmp_path / "root")
    ck, dmp, specs, opt = _checkpointer(root, 0)
    train(dmp, specs, opt, 2, torch.Generator().manual_seed(0))
    info = ck.save(1).wait()
    ck.close()
    path = os.path.join(root, manifest_path(info.id))
    body = read_combined_at(path)
    report = body["ranks"][0]
    table, entries = next(iter(report["tables"].items()))
    entry = entries[0]
    field = f"ranks[0].tables[{table!r}][0].rows"
    if how.startswith("an entry whose"):
        entry["rows"] = [entry["rows"][0], 31_250_000_000]  # 125 GB of float32 rows of 1 column
    elif how.startswith("an entry shifted"):
        # Same width, so its ids, rows and blobs still agree with it; it now starts at the table's end.
        r0, r1 = entry["rows"]
        entry["rows"] = [body["tables"][table][0], body["tables"][table][0] + r1 - r0]
    elif how.startswith("a blob shape"):
        name = entry["weights"]["blobs"]["payload"]
        report["blobs"][name]["shape"] = [report["blobs"][name]["shape"][0] + 1] + report["blobs"][name]["shape"][1:]
        field = f"ranks[0].blobs[{name!r}].nbytes"
    elif how == "a reversed row range":
        entry["rows"] = entry["rows"][::-1] if entry["rows"][0] != entry["rows"][1] else [5, 1]
    else:
        entry["cols"] = [-8, entry["cols"][1]]
        field = f"ranks[0].tables[{table!r}][0].cols"
    write_combined_at(path, body)
    # A rank's report is its part (format 7): the error names the part, and the field inside it.
    where, field = part_path(info.id, 0), field.removeprefix("ranks[0].")
    restorer, *_ = _checkpointer(root, 1)
    with pytest.raises(CorruptCheckpointError) as e:
        restorer.restore()
    assert where in str(e.value) and field in str(e.value), str(e.value)
    problems = verify_root(root)
    assert any(p.path == where and field in p.message for p in problems), problems


def test_a_row_mode_count_the_bitmap_does_not_hold_is_refused_by_restore_and_verify(group, tmp_path):
    """A count the schema accepts (within the entry, the report's whole_rows moved with it) but that the bitmap
    does not hold: the restore refuses it naming the rank file, and `cnr verify` names it too."""
    from cnr_torchrec.ckpt.tools.verify import verify_root
    from cnr_torchrec.errors import CorruptCheckpointError

    root = str(tmp_path / "root")
    path, _ = _delta_manifest(root)
    body = read_combined_at(path)
    at, _, entry = _entry(body, "whole")
    step = -1 if entry["whole"]["count"] > 1 else 1
    entry["whole"]["count"] += step
    body["ranks"][0]["whole_rows"] += step
    write_combined_at(path, body)
    restorer, *_ = _checkpointer(root, 1)
    with pytest.raises(CorruptCheckpointError, match=r"rank-00000\.bin: table '\w+': the row-mode bitmap sets"):
        restorer.restore()
    problems = verify_root(root)
    assert any("row-mode bitmap sets" in p.message for p in problems), problems


# ---------------------------------------------------------------------- one check at a time


@pytest.fixture(scope="module")
def saved_bodies(group, tmp_path_factory):
    """The JSON bodies of a real baseline and a real delta over every sharding type (one rank), each with its
    rank's part under ``ranks`` (:func:`combined_body`), as the schema checks a format 6 manifest."""
    from cnr_torchrec.ckpt.format.bytes.storage import Storage

    root = str(tmp_path_factory.mktemp("schema") / "root")
    ck, dmp, specs, opt = _checkpointer(root, 0)
    gen = torch.Generator().manual_seed(0)
    ids = []
    for step in (1, 2):
        train(dmp, specs, opt, 2, gen)
        ids.append(ck.save(step).wait().id)
    ck.close()
    storage = Storage(root)
    try:
        return [combined_body(storage, i) for i in ids]
    finally:
        storage.close()


def _entry(body, where):
    """The first entry of rank 0 that has ``where`` ("ids", "states"): (its field path, the entry)."""
    for table, entries in body["ranks"][0]["tables"].items():
        for j, e in enumerate(entries):
            if e.get(where):
                return f"ranks[0].tables[{table!r}][{j}]", table, e
    raise AssertionError(f"no entry with {where}")


def _blob_of(body, name):
    return body["ranks"][0]["blobs"][name]


def _shift_entry(body):
    """An entry moved whole past the end of its table: every other field still agrees with it."""
    at, table, e = _entry(body, "ids")
    r0, r1 = e["rows"]
    end = body["tables"][table][0]
    e["rows"] = [end, end + r1 - r0]
    return f"{at}.rows"


def _rows_written(body):
    body["ranks"][0]["rows_written"] += 1
    return "ranks[0].rows_written"


def _ids_count(body):
    at, _, e = _entry(body, "ids")
    e["ids"]["count"] = e["rows"][1] - e["rows"][0] + 1
    return f"{at}.ids.count"


def _ids_blob(body):
    at, _, e = _entry(body, "ids")
    blob = _blob_of(body, e["ids"]["blob"])
    blob["shape"][0] += 1
    blob["nbytes"] = blob["shape"][0] * (1 if blob["dtype"] == "uint8" else 4)  # bytes agree with the shape
    return f"{at}.ids.blob"


def _whole_on_a_plain_entry(body):
    at, _, e = _entry(body, "whole")
    del e["residual"]
    return f"{at}.whole"


def _whole_blob(body):
    at, _, e = _entry(body, "whole")
    blob = _blob_of(body, e["whole"]["blob"])
    blob["shape"][0] += 1
    blob["nbytes"] += 1
    return f"{at}.whole.blob"


def _whole_count(body):
    at, _, e = _entry(body, "whole")
    e["whole"]["count"] = (e["ids"]["count"] if "ids" in e else e["rows"][1] - e["rows"][0]) + 1
    return f"{at}.whole.count"


def _meta(key, delta):
    def mutate(body):
        at, _, e = _entry(body, "ids")
        e["weights"]["meta"][key] += delta
        return f"{at}.weights.meta.{key}"
    return mutate


def _weights_blobs(body):
    at, _, e = _entry(body, "ids")
    e["weights"]["blobs"]["zzz"] = e["weights"]["blobs"]["payload"]
    return f"{at}.weights.blobs"


def _state_blob(body):
    at, _, e = _entry(body, "states")
    e["states"][0]["rowwise"] = not e["states"][0]["rowwise"]
    return f"{at}.states[0].blob"


def _cols(body):
    at, _, e = _entry(body, "ids")
    e["cols"] = [e["cols"][0], e["cols"][0]]
    return f"{at}.cols"


def _chunk_nbytes(body):
    body["ranks"][0]["chunks"][0]["nbytes"] += 64
    return "ranks[0].chunks[0].nbytes"


def _blob_offset(body):
    name = next(iter(body["ranks"][0]["blobs"]))
    _blob_of(body, name)["offset"] = body["ranks"][0]["nbytes"]
    return f"ranks[0].blobs[{name!r}].offset"


def _blob_nbytes(body):
    name = next(iter(body["ranks"][0]["blobs"]))
    _blob_of(body, name)["nbytes"] += 1
    return f"ranks[0].blobs[{name!r}].nbytes"


def _replicated_shape(body):
    table, name = next(iter(body["ranks"][0]["replicated_tables"].items()))
    blob = _blob_of(body, name)
    blob["shape"][0] -= 1
    blob["nbytes"] = blob["shape"][0] * blob["shape"][1] * 4
    return f"ranks[0].replicated_tables[{table!r}]"


def _dense_blob(body):
    name = next(iter(body["ranks"][0]["dense"]))
    body["ranks"][0]["dense"][name] = "no such blob"
    return f"ranks[0].dense[{name!r}]"


def _checks_rows(body):
    at, _, e = _entry(body, "ids")
    e["checks"]["rows"] = 1 if e["checks"]["rows"] > 1 else 2  # the blob then holds a CRC per other groups
    return f"{at}.checks.blob"


def _checks_dtype(body):
    at, _, e = _entry(body, "ids")
    blob = _blob_of(body, e["checks"]["blob"])
    blob["dtype"], blob["nbytes"] = "uint8", blob["nbytes"] // 4
    blob["shape"] = [blob["nbytes"]]
    return f"{at}.checks.blob"


def _rng_tensor(body):
    body["ranks"][0]["rng"]["torch"] = {"$tensor": "no such blob"}
    return "ranks[0].rng['torch']"


def _set_key(path, value):
    def mutate(body):
        node = body
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value(node[path[-1]]) if callable(value) else value
        return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".")
    return mutate


def _baseline_with_parent(body):
    body["parent"] = 0
    return "parent"


def _replicated_list(body):
    body["replicated"] = []
    return "replicated"


CHECKS = {  # the check: (which body, the mutation that only it catches; it returns the field the error names)
    "a field is missing": (1, lambda b: b.pop("restores") * 0 or "restores"),
    "a baseline has a parent": (0, _baseline_with_parent),
    "equals names a newer checkpoint": (1, lambda b: b.update(equals=b["id"]) or "equals"),
    "a table shape": (1, lambda b: b["tables"].update(t0=[10, 0]) or "tables['t0']"),
    "encodings": (1, lambda b: b["encodings"].update(t0="zip") or "encodings['t0']"),
    "replicated lists what the ranks store whole": (1, _replicated_list),
    "one report per rank": (1, lambda b: b.update(world_size=2) or "ranks"),
    "the total bytes": (1, _set_key(("nbytes",), lambda v: v + 1)),
    "a report's rank": (1, _set_key(("ranks", 0, "rank"), 1)),
    "the chunk stride": (1, _set_key(("ranks", 0, "chunk_bytes"), lambda v: v + 1)),
    "a chunk's size": (1, _chunk_nbytes),
    "a blob's size": (1, _blob_nbytes),
    "a blob inside its file": (1, _blob_offset),
    "rows written": (1, _rows_written),
    "a replicated table's blob": (1, _replicated_shape),
    "a dense parameter's blob": (1, _dense_blob),
    "a state tree's blob": (1, _rng_tensor),
    "an entry inside its table": (1, _shift_entry),
    "an entry's columns": (1, _cols),
    "an entry's encoding": (1, lambda b: _entry(b, "ids")[2].update(encoding="zip") or f"{_entry(b, 'ids')[0]}.encoding"),
    "an entry's residual flag": (1, lambda b: _entry(b, "ids")[2].update(residual=False)
                                 or f"{_entry(b, 'ids')[0]}.residual"),
    "an entry's id count": (1, _ids_count),
    "a row-mode bitmap on a plain entry": (1, _whole_on_a_plain_entry),
    "a row-mode bitmap's size": (1, _whole_blob),
    "the rows a row-mode bitmap marks": (1, _whole_count),
    "the rows the bitmaps mark": (1, _set_key(("ranks", 0, "whole_rows"), lambda v: v + 1)),
    "an entry's id blob": (1, _ids_blob),
    "the rows the codec stores": (1, _meta("num_rows", 1)),
    "the columns the codec stores": (1, _meta("dim", 1)),
    "the blobs the codec writes": (1, _weights_blobs),
    "an optimizer state's blob": (1, _state_blob),
    "the groups an entry's checks cover": (1, _checks_rows),
    "the dtype of an entry's checks": (1, _checks_dtype),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_each_schema_check_alone_refuses_its_field(saved_bodies, check):
    """One field broken, everything else as saved: the schema refuses it, and names that field first.

    Each mutation is the smallest that breaks its check alone, so removing any one check from the
    schema fails its case here (the entry shifted whole past its table is caught by nothing else)."""
    from cnr_torchrec.ckpt.format.schema import check_manifest
    from cnr_torchrec.errors import CorruptCheckpointError

    which, mutate = CHECKS[check]
    body = copy.deepcopy(saved_bodies[which])
    check_manifest(copy.deepcopy(body), "ckpt/manifest.json")  # as saved, it passes
    field = mutate(body)
    with pytest.raises(CorruptCheckpointError) as e:
        check_manifest(body, "ckpt/manifest.json")
    assert str(e.value).startswith(f"ckpt/manifest.json: {field} "), (field, str(e.value))


def test_a_blob_of_a_dtype_never_written_is_refused_as_unsafe(saved_bodies):
    from cnr_torchrec.ckpt.format.schema import check_manifest
    from cnr_torchrec.errors import UnsafeCheckpointError

    body = copy.deepcopy(saved_bodies[1])
    name = next(iter(body["ranks"][0]["blobs"]))
    body["ranks"][0]["blobs"][name]["dtype"] = "object"
    with pytest.raises(UnsafeCheckpointError, match=rf"ranks\[0\]\.blobs\['{re.escape(name)}'\]\.dtype is 'object'"):
        check_manifest(body, "ckpt/manifest.json")


def test_the_schema_builds_the_typed_manifest_it_checked(saved_bodies):
    """What the schema check returns reads back every field of the JSON it checked."""
    from cnr_torchrec.ckpt.format.schema import check_manifest

    body = saved_bodies[1]
    m = check_manifest(copy.deepcopy(body), "ckpt/manifest.json")
    assert (m.id, m.step, m.kind, m.parent, m.base, m.depth) == tuple(
        body[k] for k in ("id", "step", "kind", "parent", "base", "depth"))
    assert dict(m.tables) == {t: tuple(s) for t, s in body["tables"].items()}
    report, raw = m.ranks[0], body["ranks"][0]
    assert report.nbytes == raw["nbytes"] and report.rows_written == raw["rows_written"]
    assert [c.nbytes for c in report.payload.chunks] == [c["nbytes"] for c in raw["chunks"]]
    assert {n: (b.offset, b.nbytes, b.dtype, list(b.shape)) for n, b in report.blobs.items()} == {
        n: (b["offset"], b["nbytes"], b["dtype"], b["shape"]) for n, b in raw["blobs"].items()}
    for table, entries in raw["tables"].items():
        for got, e in zip(report.tables[table], entries):
            assert (list(got.rows), list(got.cols), got.encoding) == (e["rows"], e["cols"], e["encoding"])
            assert (got.ids is None) == ("ids" not in e)
            if got.ids is not None:
                assert (got.ids.kind, got.ids.count, got.ids.blob) == (e["ids"]["kind"], e["ids"]["count"],
                                                                     e["ids"]["blob"])
            assert dict(got.weights.blobs) == e["weights"]["blobs"] and dict(got.weights.meta) == e["weights"]["meta"]
            assert [(s.rowwise, s.blob) for s in got.states] == [(s["rowwise"], s["blob"]) for s in e.get("states", [])]
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.step = 0
    with pytest.raises(TypeError):
        report.tables["x"] = ()
