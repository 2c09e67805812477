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
import json
import os
import re

import pytest
import torch

from _toy import build_dmp, local_state, train

PLAN = ("table_wise", "row_wise", "column_wise", "data_parallel")


class _Reader:
    def __init__(self) -> None:
        self.pos = torch.zeros(1, dtype=torch.int64)

    def state_dict(self):
        return {"pos": self.pos.clone()}

    def load_state_dict(self, sd):
        self.pos.copy_(sd["pos"])


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


@pytest.mark.timeout(600)
def test_every_field_of_a_crafted_manifest_is_refused_by_name_or_harmless(group, tmp_path):
    from cnr_torchrec.ckpt.format.manifest import manifest_path, seal
    from cnr_torchrec.errors import CorruptCheckpointError, IncompatibleCheckpointError, UnsafeCheckpointError

    root = str(tmp_path / "root")
    ck, dmp, specs, opt = _checkpointer(root, 0)
    gen = torch.Generator().manual_seed(0)
    for step in (1, 2):
        train(dmp, specs, opt, 2, gen)
        info = ck.save(step).wait()
    ck.close()
    path = os.path.join(root, manifest_path(info.id))
    raw = open(path, "rb").read()
    body = json.loads(raw)["body"]
    assert body["kind"] == "delta" and any("ids" in e for r in body["ranks"] for es in r["tables"].values()
                                           for e in es)

    restorer, fresh, _, _ = _checkpointer(root, 1)
    assert restorer.restore() == 2
    want = local_state(fresh)

    outcomes = {"named": 0, "identical": 0}
    problems = []
    for field, value in _fields(body):
        for how, new in _mutations(value):
            mutated = copy.deepcopy(body)
            _set(mutated, field, how, new)
            with open(path, "wb") as f:
                f.write(seal(mutated))
            name = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in field)
            try:
                got_step = restorer.restore()
            except (CorruptCheckpointError, UnsafeCheckpointError, IncompatibleCheckpointError) as e:
                outcomes["named"] += 1
                if not re.search(r"ckpt-\d{8}/(manifest.json|rank-)|checkpoint 1\b", str(e)):
                    problems.append(f"{name} {how}: the error names no file: {e}")
                continue
            except Exception as e:  # noqa: BLE001 - the point of the test
                problems.append(f"{name} {how}: {type(e).__name__}: {e}")
                continue
            got = local_state(fresh)
            if got_step != mutated["step"] or any(not torch.equal(got[k], want[k]) for k in want):
                problems.append(f"{name} {how}: restored other values without an error")
            else:
                outcomes["identical"] += 1
    with open(path, "wb") as f:
        f.write(raw)
    print(f"mutations: {outcomes}")  # shown with -s
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
    from cnr_torchrec.ckpt.format.manifest import manifest_path, seal
    from cnr_torchrec.ckpt.tools.verify import verify_root
    from cnr_torchrec.errors import CorruptCheckpointError

    root = str(tmp_path / "root")
    ck, dmp, specs, opt = _checkpointer(root, 0)
    train(dmp, specs, opt, 2, torch.Generator().manual_seed(0))
    info = ck.save(1).wait()
    ck.close()
    path = os.path.join(root, manifest_path(info.id))
    body = json.loads(open(path, "rb").read())["body"]
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
    with open(path, "wb") as f:
        f.write(seal(body))
    restorer, *_ = _checkpointer(root, 1)
    with pytest.raises(CorruptCheckpointError) as e:
        restorer.restore()
    assert manifest_path(info.id) in str(e.value) and field in str(e.value), str(e.value)
    problems = verify_root(root)
    assert any(p.path == manifest_path(info.id) and field in p.message for p in problems), problems
