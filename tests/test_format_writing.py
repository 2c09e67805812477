"""The format's writer (cnr_torchrec/ckpt/format/writing.py): its conditional keys, and bodies the schema accepts.

End to end, every writer of the format goes through it (a save, the merge, the fold, cnr compact, the DCP
import), and their tests restore what it wrote; here, the keys it leaves out or refuses.
"""

from __future__ import annotations

import json

import pytest

from cnr_torchrec.ckpt.format import writing
from cnr_torchrec.ckpt.format.writing import ChainLinks, JobFields

_STORED = writing.row_keys({"method": "none"}, {"payload": "s0/w/payload"}, [(True, "s0/state0")], ("s0/crc32c", 8))


def test_an_entry_carries_ids_modes_and_residual_only_where_given():
    plain = writing.table_entry((0, 10), (0, 4), "full", _STORED)
    assert {"ids", "residual", "whole"}.isdisjoint(plain)
    assert plain["rows"] == [0, 10] and plain["checks"] == {"blob": "s0/crc32c", "rows": 8}
    delta = writing.table_entry((0, 10), (0, 4), "rows", _STORED, ids=("list", 3, "s0/ids"), residual=True,
                                whole=(1, "s0/whole"))
    assert delta["ids"] == {"kind": "list", "count": 3, "blob": "s0/ids"}
    assert delta["residual"] is True and delta["whole"] == {"count": 1, "blob": "s0/whole"}
    with pytest.raises(ValueError, match="only a residual entry"):
        writing.table_entry((0, 10), (0, 4), "rows", _STORED, whole=(1, "s0/whole"))


def test_a_report_leaves_out_zero_counts_and_an_empty_mc_runtime():
    payload = {"file": "f", "nbytes": 0, "chunk_bytes": 1, "chunks": [], "blobs": {}}
    bare = writing.rank_report(1, payload, tables={}, table_shapes={"t": (4, 2)}, tbe_iter=3,
                               counts=writing.WriteCounts(0))
    assert {"residual_entries", "whole_rows", "mc_runtime"}.isdisjoint(bare)
    assert bare["table_shapes"] == {"t": [4, 2]} and bare["ok"] is True and bare["file"] == "f"
    full = writing.rank_report(1, payload, tables={}, table_shapes={}, tbe_iter=3,
                               counts=writing.WriteCounts(5, residual_entries=2, whole_rows=4),
                               state=writing.StateBlobs(mc_runtime={"t": {"x": 1}}))
    assert (full["residual_entries"], full["whole_rows"], full["mc_runtime"]) == (2, 4, {"t": {"x": 1}})
    assert writing.failed_report(2, "why") == {"rank": 2, "ok": False, "error": "why"}


def test_a_body_takes_replicated_tables_from_its_parts_unless_told():
    parts = [{"rank": 0, "line": {"payload": 5}, "replicated": ["b"]},
             {"rank": 1, "line": {"payload": 7}, "replicated": ["a"]}]
    links = ChainLinks(3, 30, "delta", "previous", 2, 0, 3, {"a": "rows"}, "why")
    job = JobFields(policy="consecutive", world_size=2, codec=writing.codec_description("none", None, {}), restores=1)
    body = writing.manifest_body(links, job, tables={"a": (4, 2), "b": (2, 2)}, parts=parts)
    assert body["replicated"] == ["a", "b"] and body["nbytes"] == 12 and body["depth"] == 3
    assert body["parts"] == [{"payload": 5}, {"payload": 7}]
    assert {"equals", "compacted_from", "per_rank_state", "shards", "ranks"}.isdisjoint(body)
    compacted = writing.manifest_body(ChainLinks.baseline(4, 30, {"a": "full"}, "folded"), job, tables={},
                                      parts=parts, replicated=[], equals=3, compacted_from=(0, 3),
                                      per_rank_state=False)
    assert compacted["replicated"] == [] and compacted["compacted_from"] == [0, 3] and compacted["equals"] == 3
    assert (compacted["kind"], compacted["parent"], compacted["base"]) == ("baseline", None, 4)
    assert compacted["per_rank_state"] is False


def test_shards_take_the_even_row_rule_where_it_holds_and_list_the_rest():
    """Rows in even blocks, one per rank in rank order, full width: a rule; any other layout: a list."""
    tables = {"even": (10, 4), "cols": (8, 4), "skew": (10, 4)}
    boxes = [[["even", 0, 4, 0, 4], ["cols", 0, 8, 0, 2], ["skew", 0, 3, 0, 4]],
             [["even", 4, 8, 0, 4], ["cols", 0, 8, 2, 4], ["skew", 3, 10, 0, 4]],
             [["even", 8, 10, 0, 4]]]
    shards = writing.shards_of(tables, boxes)
    assert shards["even"] == {"rows": 4}
    assert shards["cols"] == [[0, 0, 8, 0, 2], [1, 0, 8, 2, 4]]
    assert shards["skew"] == [[0, 0, 3, 0, 4], [1, 3, 10, 0, 4]]


def test_a_part_says_the_codec_once_and_reads_back_as_its_report():
    """The codec's description that every entry repeats is the part's ``meta``; each entry keeps dim and num_rows;
    expanding gives back the report exactly."""
    from cnr_torchrec.ckpt.format.parts import expand_part, part_bytes

    codec = {"format": "cnr_torchrec.quant.EncodedRows", "version": 1, "method": "adaptive", "bits": 4,
             "params": {"num_bins": 25}}
    tables = {"t": [writing.table_entry((0, 8), (0, 4), "full", writing.row_keys(
        {**codec, "dim": 4, "num_rows": 8}, {"payload": f"e{i}/w"}, [], (f"e{i}/crc", 2))) for i in range(3)]}
    report = writing.rank_report(0, {"file": "f", "nbytes": 0, "blobs": {}}, tables=tables,
                                 table_shapes={"t": [8, 4]}, tbe_iter=1, counts=writing.WriteCounts(24))
    raw = json.loads(part_bytes(7, report))
    assert raw["meta"] == codec
    assert all(set(e["weights"]["meta"]) == {"dim", "num_rows"} for e in raw["tables"]["t"])
    assert expand_part(raw) == {"ckpt": 7, **report}
    assert len(part_bytes(7, report)) < len(json.dumps({"ckpt": 7, **report}, separators=(",", ":")))
