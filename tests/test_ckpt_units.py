"""Checkpoint building blocks, one process, no training: planner rules, payload blobs and nested
state, storage paths and atomic writes, sealed manifests, row-id encoding and RNG state."""

from __future__ import annotations

import json
import math
import os
import random
from fractions import Fraction

import numpy as np
import pytest
import torch
import xxhash

from cnr_torchrec.ckpt.format.commits import (
    INDEX,
    ckpt_dir,
    committed_ids,
    load_manifest,
    read_body,
    manifest_path,
    rank_file,
    seal,
    write_index,
)
from cnr_torchrec.ckpt.format.chunks import PayloadReader
from cnr_torchrec.ckpt.format.schema import check_payload
from cnr_torchrec.ckpt.format.payload import BlobWriter, flatten_state, read_blob, unflatten_state
from cnr_torchrec.ckpt.save.planner import ChainState, Decision, decide, intermittent_wants_baseline
from cnr_torchrec.ckpt.format.state import decode_ids, encode_ids, rng_state, set_rng_state
from cnr_torchrec.ckpt.format.storage import Storage, check_relative, checksum
from cnr_torchrec.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    IncompatibleCheckpointError,
    UnsafeCheckpointError,
)

POLICIES = ("full", "one_shot", "consecutive", "intermittent")


def xxh3_reference(data: bytes) -> str:
    """XXH3-128 from xxhash's own binding of the reference C library, as hex."""
    return xxhash.xxh3_128_hexdigest(bytes(data))


def test_checksum_is_xxh3_128():
    # Published XXH3-128 value of the empty input (xxhash's test vectors).
    assert checksum(b"") == "99aa06d3014798d86001c324468d497f"
    data = bytearray(range(256)) * 1000
    assert checksum(data) == checksum(memoryview(data)) == checksum(bytes(data)) == xxh3_reference(data)
    data[12345] ^= 1
    assert checksum(data) != xxh3_reference(bytes(range(256)) * 1000)


@pytest.fixture
def storage(tmp_path):
    s = Storage(str(tmp_path / "root"))
    yield s
    s.close()


# ---- planner -----------------------------------------------------------------------

HELD = {"a": 100, "b": 40}


def plan(policy, state, step=0, prev=None, base=None, held=HELD, fraction=0.5, force=""):
    return decide(policy=policy, state=state, step=step, dirty_since_previous=prev or {},
                  dirty_since_baseline=base or {}, held_rows=held, full_shard_fraction=fraction,
                  force_baseline=force)


@pytest.mark.parametrize("policy", POLICIES)
def test_first_checkpoint_is_a_baseline(policy):
    d = plan(policy, ChainState(), step=7, prev={"a": 1}, base={"a": 1})
    assert d == Decision(ckpt_id=0, step=7, kind="baseline", since=None, parent=None, chain=(0,),
                         encodings={"a": "full", "b": "full"}, reason="first checkpoint")


@pytest.mark.parametrize("policy", POLICIES)
def test_force_baseline_wins_over_every_policy(policy):
    state = ChainState(5, (2, 3, 4), 1000, (1, 1))
    d = plan(policy, state, step=9, base={"a": 1}, prev={"a": 1}, force="after restore")
    assert (d.kind, d.ckpt_id, d.parent, d.chain, d.since, d.reason) == ("baseline", 5, None, (5,), None,
                                                                        "after restore")
    assert d.encodings == {"a": "full", "b": "full"}


def test_policy_full_always_baselines():
    state = ChainState()
    for i in range(4):
        d = plan("full", state, step=10 * i, prev={"a": 1}, base={"a": 1})
        assert (d.kind, d.ckpt_id, d.chain, d.parent) == ("baseline", i, (i,), None)
        assert d.reason == ("first checkpoint" if i == 0 else "policy full")
        state = state.committed(d, 1000)
        assert state == ChainState(i + 1, (i,), 1000, ())


def test_policy_one_shot_chain_is_baseline_plus_this():
    state = ChainState()
    d = plan("one_shot", state)
    state = state.committed(d, 500)
    for i in range(1, 5):
        d = plan("one_shot", state, step=i, prev={"a": 1}, base={"a": 2 * i})
        assert (d.kind, d.since, d.parent, d.chain, d.ckpt_id) == ("delta", "baseline", 0, (0, i), i)
        assert d.reason == "policy one_shot"
        state = state.committed(d, 10 * i)
        assert state == ChainState(i + 1, (0, i), 500, tuple(10 * j for j in range(1, i + 1)))


def test_policy_consecutive_chain_grows():
    state = ChainState()
    d = plan("consecutive", state)
    state = state.committed(d, 500)
    for i in range(1, 5):
        d = plan("consecutive", state, step=i, prev={"a": 1}, base={"a": 2 * i})
        assert (d.kind, d.since, d.parent, d.chain) == ("delta", "previous", i - 1, tuple(range(i + 1)))
        state = state.committed(d, 7)
        assert state == ChainState(i + 1, tuple(range(i + 1)), 500, (7,) * i)


@pytest.mark.parametrize("policy,since", [("one_shot", "base"), ("intermittent", "base"), ("consecutive", "prev")])
def test_encodings_use_the_policys_dirty_counts(policy, since):
    """one_shot/intermittent look at rows dirty since the baseline, consecutive at rows since the previous."""
    state = ChainState(1, (0,), 10**9, ())  # a huge baseline keeps intermittent from re-baselining
    many, few = {"a": 90, "b": 39}, {"a": 1, "b": 0}
    d = plan(policy, state, prev=many if since == "prev" else few, base=many if since == "base" else few)
    assert d.kind == "delta"
    assert d.encodings == {"a": "full", "b": "full"}
    d = plan(policy, state, prev=few if since == "prev" else many, base=few if since == "base" else many)
    assert d.encodings == {"a": "rows", "b": "rows"}


@pytest.mark.parametrize("fraction,rows,dirty", [
    (0.5, 100, 50), (0.5, 100, 49), (0.5, 101, 50), (0.5, 101, 51), (0.25, 8, 2), (0.25, 8, 1),
    (1.0, 10, 10), (1.0, 10, 9), (0.01, 1000, 10), (0.01, 1000, 9), (0.3, 10, 3), (0.07, 100, 7), (0.07, 100, 6),
    (0.5, 1, 0), (0.5, 1, 1),
])
@pytest.mark.parametrize("policy", ["one_shot", "consecutive"])
def test_encoding_threshold_boundary(policy, fraction, rows, dirty):
    """'full' exactly when the dirty share dirty/rows is at least the fraction (as written in the config)."""
    expected = "full" if Fraction(dirty, rows) >= Fraction(str(fraction)) else "rows"
    d = plan(policy, ChainState(1, (0,), 100, ()), prev={"t": dirty}, base={"t": dirty}, held={"t": rows},
             fraction=fraction)
    assert d.encodings == {"t": expected}


def test_table_without_rows_or_counts():
    """A table this job holds no rows of, or with no dirty count, is written as (no) rows."""
    d = plan("one_shot", ChainState(1, (0,), 100, ()), base={"x": 5}, held={"empty": 0, "clean": 10})
    assert d.encodings == {"empty": "rows", "clean": "rows"}


@pytest.mark.parametrize("baseline,deltas,predicted,want", [
    (100, (), 10**9, False),  # no delta yet: never re-baseline
    (100, (10,), 54.9, False),  # average (100 + 10) / 2 = 55
    (100, (10,), 55, True),
    (100, (10, 20, 30), 39.99, False),  # average 160 / 4 = 40
    (100, (10, 20, 30), 40, True),
    (0, (0,), 0, True),
    (1000, (100, 200), 433, False),  # average 1300 / 3 = 433.33
    (1000, (100, 200), 434, True),
])
def test_intermittent_rule(baseline, deltas, predicted, want):
    got, reason = intermittent_wants_baseline(baseline, deltas, predicted)
    assert got is want
    assert f"{len(deltas)} deltas" in reason


def test_intermittent_sequence_against_hand_computed_reference():
    """B = 100 bytes over 100 rows; one-shot deltas grow by 10 rows (so ~10 bytes) a save.

    By hand: the first delta (10) follows a lone baseline, which never restarts the chain;
    after deltas 10, 20, 30 the chain average is (100+10+20+30)/4 = 40 and the next
    delta is predicted at 40 >= 40, so the 5th save is a new baseline; earlier averages 55 and
    43.3 beat the predictions 20 and 30. After the new baseline the same pattern repeats.
    """
    expected = ["baseline", "delta", "delta", "delta", "baseline", "delta", "delta", "delta", "baseline"]
    expected_chain = [(0,), (0, 1), (0, 2), (0, 3), (4,), (4, 5), (4, 6), (4, 7), (8,)]
    state, grown, got, chains = ChainState(), 0, [], []
    for step in range(len(expected)):
        d = plan("intermittent", state, step=step, base={"a": grown, "b": 0}, prev={"a": 10},
                 held={"a": 90, "b": 10})  # "a" stays under the whole-shard threshold (40/90 < 0.5)
        got.append(d.kind)
        chains.append(d.chain)
        if d.kind == "baseline":
            state, grown = state.committed(d, 100), 10
        else:
            assert d.reason.startswith("intermittent: ") and (d.since, d.parent) == ("baseline", d.chain[0])
            state, grown = state.committed(d, grown), grown + 10
    assert got == expected
    assert chains == expected_chain
    assert state == ChainState(9, (8,), 100, ())


def test_intermittent_predicts_whole_shards_past_the_threshold():
    """Past full_shard_fraction a table is written whole, so the prediction counts all its rows:
    B = 100 bytes over 100 rows, one delta of 20; "a" has 30 of 60 rows dirty, so the next delta
    writes 60 rows (~60 bytes), which beats the chain average (100 + 20) / 2 = 60: new baseline.
    Counting only the 30 dirty rows would have predicted 30 and kept going."""
    state = ChainState(2, (0, 1), 100, (20,))
    d = plan("intermittent", state, base={"a": 30, "b": 0}, held={"a": 60, "b": 40})
    assert d.kind == "baseline" and "~0.00 MB" in d.reason
    d = plan("intermittent", state, base={"a": 29, "b": 0}, held={"a": 60, "b": 40})
    assert d.kind == "delta" and d.encodings == {"a": "rows", "b": "rows"}


def test_failed_save_restarts_with_a_baseline():
    state = ChainState(3, (0, 1, 2), 100, (5, 6))
    d = plan("consecutive", state, prev={"a": 1})
    assert (d.kind, d.ckpt_id) == ("delta", 3)
    after = state.failed(d)
    assert after == ChainState(4, (), 0, ())
    nxt = plan("consecutive", after, prev={"a": 1})
    assert (nxt.kind, nxt.ckpt_id, nxt.chain, nxt.reason) == ("baseline", 4, (4,), "first checkpoint")
    # An id already past the failed one is never reused.
    assert ChainState(9, (7, 8)).failed(d) == ChainState(9)


def test_decision_to_json():
    d = plan("consecutive", ChainState(2, (0, 1), 10, (1,)), step=42, prev={"a": 60})
    assert json.loads(json.dumps(d.to_json())) == {
        "id": 2, "step": 42, "kind": "delta", "since": "previous", "parent": 1, "base": 0, "depth": 2,
        "encodings": {"a": "full", "b": "rows"}, "reason": "policy consecutive",
    }


# ---- payload: blobs ------------------------------------------------------------------

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
          torch.float16, torch.bfloat16, torch.float32, torch.float64]


def sample(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_blob_round_trip(dtype, storage):
    """Tensors of every shape (empty, 0-d, non-contiguous) come back bit for bit, with their index entry."""
    tensors = {
        "empty": sample(dtype, (0,)),
        "empty2d": sample(dtype, (3, 0)),
        "scalar": sample(dtype, ()),
        "matrix": sample(dtype, (5, 7), seed=1),
        "transposed": sample(dtype, (4, 6), seed=2).t(),
        "cube": sample(dtype, (2, 3, 4), seed=3),
    }
    w = BlobWriter()
    for name, t in tensors.items():
        assert w.add(name, t) == name
    data = w.getvalue()
    assert w.nbytes == len(data)
    offset = 0
    for name, t in tensors.items():
        flat = t.contiguous()
        raw = (flat.view(torch.int16) if dtype == torch.bfloat16 else flat).numpy().tobytes()  # numpy has no bf16
        meta = w.index[name]
        offset += -offset % BlobWriter.ALIGN  # blobs start on 64-byte boundaries, zero padding between
        assert meta == {"offset": offset, "nbytes": len(raw), "dtype": str(dtype).removeprefix("torch."),
                        "shape": list(t.shape), "xxh3": xxh3_reference(raw)}
        assert data[offset : offset + len(raw)] == raw
        offset += len(raw)
    assert offset == len(data)
    storage.write("p.bin", data)
    index = json.loads(json.dumps(w.index))  # as it comes back from a manifest
    whole = bytearray(data)
    for name, t in tensors.items():
        got = _range_read(storage, "p.bin", index, name)
        assert got.dtype == dtype and got.shape == t.shape
        assert torch.equal(got, t)
        at = memoryview(whole)[index[name]["offset"] : index[name]["offset"] + index[name]["nbytes"]]
        blob = check_payload({"file": "p.bin", "nbytes": len(data), "xxh3": "", "blobs": index}, "r").blobs[name]
        in_place = read_blob("p.bin", blob, name, at)  # a view of the caller's buffer
        assert torch.equal(in_place, t)
        if t.numel():
            assert in_place.untyped_storage().data_ptr() == torch.frombuffer(at, dtype=torch.uint8).data_ptr()


def test_blob_rejects_unsupported_dtype_and_duplicate_names():
    w = BlobWriter()
    with pytest.raises(CheckpointError, match="complex64"):
        w.add("c", torch.zeros(2, dtype=torch.complex64))
    w.add("x", torch.zeros(2))
    with pytest.raises(ValueError, match="added twice"):
        w.add("x", torch.zeros(2))


def _range_read(storage, file, index, name):
    """One blob by a range read, as restore reads a few small blobs of a big payload (a one-file report)."""
    payload = check_payload({"file": file, "nbytes": 1 << 40, "xxh3": "", "blobs": index}, "report")
    return PayloadReader(storage, payload, whole=False)(name)


def _written(storage, tensors):
    w = BlobWriter()
    for name, t in tensors.items():
        w.add(name, t)
    storage.write("ckpt-00000000/rank-00000.bin", w.getvalue())
    return "ckpt-00000000/rank-00000.bin", w.getvalue(), w.index


@pytest.mark.parametrize("where", [0, 17, 39])
def test_read_blob_detects_a_flipped_byte(storage, where):
    file, data, index = _written(storage, {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(3)})
    bad = bytearray(data)
    bad[where] ^= 0x01
    storage.write(file, bytes(bad))
    with pytest.raises(CorruptCheckpointError, match="checksum") as e:
        _range_read(storage, file, index, "a")
    assert e.value.path == file and file in str(e.value)
    assert torch.equal(_range_read(storage, file, index, "b"), torch.ones(3))  # the other blob is fine


@pytest.mark.parametrize("keep", [0, 5, 51])
def test_read_blob_detects_truncation(storage, keep):
    file, data, index = _written(storage, {"a": torch.ones(3), "b": torch.arange(10, dtype=torch.float32)})
    storage.write(file, data[:keep])
    with pytest.raises(CorruptCheckpointError, match="truncated") as e:
        _range_read(storage, file, index, "b")
    assert e.value.path == file and file in str(e.value)


def test_read_blob_refuses_an_unknown_dtype(storage):
    file, _, index = _written(storage, {"a": torch.ones(3)})
    with pytest.raises(UnsafeCheckpointError, match="object"):
        _range_read(storage, file, {"a": {**index["a"], "dtype": "object"}}, "a")


# ---- payload: nested state -----------------------------------------------------------


def assert_same(got, want, where="state"):
    """Equal values of the same types all the way down (tuples stay tuples, int keys stay ints)."""
    assert type(got) is type(want), f"{where}: {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert list(got) == list(want) and [type(k) for k in got] == [type(k) for k in want], where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), where
    else:
        assert got == want, where


def round_trip(storage, obj, name="ckpt-00000000/rank-00000.bin"):
    """flatten -> JSON text + payload file -> read back -> unflatten."""
    blobs = BlobWriter()
    tree = flatten_state(obj, "x", blobs, "x")
    text = json.dumps(tree)
    storage.write(name, blobs.getvalue())
    index = json.loads(json.dumps(blobs.index))
    return unflatten_state(json.loads(text), lambda b: _range_read(storage, name, index, b))


def _adam_pair():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.95), amsgrad=True)
    return model, opt


def _step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    loss = model(torch.randn(8, 4, generator=g)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_optimizer_state_round_trip(storage):
    """An Adam state_dict after a step comes back equal, and training continues identically."""
    model, opt = _adam_pair()
    _step(model, opt, 1)
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1, 2, 3] and isinstance(sd["param_groups"][0]["betas"], tuple)
    got = round_trip(storage, sd)
    assert_same(got, sd)

    twin, twin_opt = _adam_pair()
    twin.load_state_dict(model.state_dict())
    twin_opt.load_state_dict(got)
    _step(model, opt, 2)
    _step(twin, twin_opt, 2)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)


def test_nested_state_round_trip(storage):
    """Int, float, bool and None keys, '$'-prefixed string keys, tuples, nested lists, empty containers."""
    obj = {
        "ints": {0: torch.ones(2), 7: (1, 2.5, None), -3: []},
        "mixed": {1: "a", "b": True, None: 0, 2.5: "f", False: [()]},
        "$tensor": "not a tensor marker",
        "dollar": {"$tuple": [1, 2], "$items": {}},
        "nested": [[torch.arange(3)], ([torch.zeros(0, 2)], {"k": ()}), [], {}],
        "scalars": [0, -1, 1.5, "s", None, True, float("inf")],
        "t": torch.tensor(3.0),
    }
    assert_same(round_trip(storage, obj), obj)
    assert_same(round_trip(storage, (torch.ones(1),)), (torch.ones(1),))
    assert round_trip(storage, 5) == 5


class _Opaque:
    pass


@pytest.mark.parametrize("obj,where,what", [
    ({1, 2}, "x", "set"),
    ({"a": [1, {"b": {3}}]}, "x['a'][1]['b']", "set"),
    ({"reader": _Opaque()}, "x['reader']", "_Opaque"),
    ([1, (2, b"bytes")], "x[1][1]", "bytes"),
    ({0: {"step": torch.device("cpu")}}, "x[0]['step']", "device"),
    ({(1, 2): 3}, "x", "tuple"),
    ({frozenset(): 3}, "x", "frozenset"),
])
def test_flatten_rejects_what_needs_pickle(obj, where, what):
    with pytest.raises(CheckpointError) as e:
        flatten_state(obj, "x", BlobWriter(), "x")
    msg = str(e.value)
    assert msg.startswith(where + ":") or msg.startswith(where + " holds"), msg
    assert what in msg


def test_scheduler_state_can_be_sealed_into_a_manifest(storage):
    """A ReduceLROnPlateau state (mode_worse and best are inf) flattened as extra state, put in a
    manifest like save.write_rank's report is, must come back from load_manifest unchanged."""
    model, opt = _adam_pair()
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    sd = sched.state_dict()
    blobs = BlobWriter()
    body = {"id": 0, "extra": {"sched": flatten_state(sd, "extra/sched", blobs, "extra_state['sched']")}}
    storage.write(manifest_path(0), seal(body))
    got = unflatten_state(read_body(storage, 0)["extra"]["sched"], lambda b: None)
    assert_same(got, sd)


# ---- storage -------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["../x", "/abs", "a/../../b", "..", "", "\\x", "./../x", "a/b/../../../c"])
def test_paths_escaping_the_root_are_rejected(path, storage):
    with pytest.raises(UnsafeCheckpointError, match="escapes the checkpoint root"):
        check_relative(path)
    for call in (lambda: storage.read(path), lambda: storage.write(path, b"x"), lambda: storage.exists(path),
                 lambda: storage.delete(path), lambda: storage.write_atomic(path, b"x")):
        with pytest.raises(UnsafeCheckpointError):
            call()


@pytest.mark.parametrize("path,norm", [("a/b", "a/b"), ("a/./b", "a/b"), ("a/../b", "b"), ("a//b/", "a/b"),
                                       ("..a", "..a")])
def test_paths_inside_the_root_are_normalized(path, norm):
    assert check_relative(path) == norm


def test_write_read_exists_delete(storage, tmp_path):
    storage.write("d/f.bin", b"0123456789")
    assert (tmp_path / "root" / "d" / "f.bin").read_bytes() == b"0123456789"
    whole = storage.read("d/f.bin")
    assert whole == b"0123456789" and isinstance(whole, bytearray)  # local whole reads are writable, not copied
    big = bytes(range(256)) * 40_000  # several read() calls' worth
    storage.write("d/big.bin", big)
    assert storage.read("d/big.bin") == big
    assert storage.read("d/f.bin", byte_range=(3, 7)) == b"3456"
    assert storage.read("d/f.bin", byte_range=(8, 20)) == b"89"
    assert storage.exists("d/f.bin") and not storage.exists("d/g.bin") and not storage.exists("d")
    storage.delete("d/f.bin")
    storage.delete("d/f.bin")  # already gone: fine
    assert not storage.exists("d/f.bin")


def test_read_missing_file(storage):
    with pytest.raises(CheckpointNotFoundError, match="nope.bin does not exist"):
        storage.read("ckpt-00000001/nope.bin")
    with pytest.raises(FileNotFoundError):
        storage.read("nope.bin", byte_range=(0, 1))


def test_write_atomic_replaces_and_leaves_no_temp_file(storage, tmp_path):
    storage.write_atomic("c/manifest.json", b"first version, longer")
    storage.write_atomic("c/manifest.json", b"second")
    assert (tmp_path / "root" / "c" / "manifest.json").read_bytes() == b"second"
    assert os.listdir(tmp_path / "root" / "c") == ["manifest.json"]
    assert storage.read("c/manifest.json") == b"second"
    storage.fsync_file("c/manifest.json")


def test_list_and_remove_dirs(tmp_path):
    s = Storage(str(tmp_path / "not-yet"))
    try:
        assert s.list_dirs() == []
        for f in ("b/x.bin", "a/y.bin", "a/sub/z.bin", "top.bin"):
            s.write(f, b"1")
        assert s.list_dirs() == ["a", "b"]
        s.remove_dir("a", ["a/y.bin"])
        assert s.list_dirs() == ["b"] and not (tmp_path / "not-yet" / "a").exists()
    finally:
        s.close()


@pytest.mark.parametrize("uri,local", [("fs://{}", True), ("{}", True)])
def test_fs_uri_is_local(uri, local, tmp_path):
    s = Storage(uri.format(tmp_path))
    try:
        assert s.local_dir == str(tmp_path)
        s.write("k.bin", b"v")
        assert (tmp_path / "k.bin").read_bytes() == b"v"
    finally:
        s.close()


def test_non_listing_backend_reads_through_the_plugin(storage):
    storage.write("d/f.bin", b"abc")
    storage.local_dir = None
    assert storage.list_dirs() is None
    assert storage.exists("d/f.bin") and not storage.exists("d/missing.bin")
    storage.write_atomic("d/g.bin", b"xyz")  # a single PUT
    assert storage.read("d/g.bin") == b"xyz"


# ---- manifests -----------------------------------------------------------------------

BODY = {"id": 3, "step": 12345, "kind": "delta", "base": 0, "depth": 2, "parent": 2, "since": "previous",
        "encodings": {"t": "rows"}, "nbytes": 4096, "lr": 0.015625, "reason": "policy consecutive"}


def test_a_version_2_manifest_gets_the_links_its_chain_list_gave(storage):
    old = {k: v for k, v in BODY.items() if k not in ("base", "depth")} | {"chain": [0, 2, 3]}
    storage.write(manifest_path(3), seal(old, version=2))
    assert read_body(storage, 3) == old | {"base": 0, "depth": 2}


def test_manifest_paths():
    assert ckpt_dir(3) == "ckpt-00000003"
    assert manifest_path(12) == "ckpt-00000012/manifest.json"
    assert rank_file(7, 2) == "ckpt-00000007/rank-00002.bin"


def test_seal_and_load(storage):
    raw = seal(BODY)
    doc = json.loads(raw)
    assert doc["format"] == "cnr-checkpoint" and doc["version"] == 6 and doc["body"] == BODY
    # The checksum covers the body's text as it stands in the file, between '"body": ' and the closing brace.
    text = raw[raw.index(b'"body": ') + len(b'"body": ') : raw.rindex(b"}")]
    assert json.loads(text) == BODY
    assert doc["xxh3"] == xxh3_reference(text)
    assert list(doc) == ["format", "version", "xxh3", "body"]
    storage.write(manifest_path(3), raw)
    assert read_body(storage, 3) == BODY


@pytest.mark.parametrize("old,new", [
    (b'"step": 12345', b'"step": 12346'),
    (b'"lr": 0.015625', b'"lr": 0.015624'),
    (b'"delta"', b'"delte"'),
    (b'"parent": 2', b'"parent": 3'),
    (b'"depth": 2', b'"depth": 1'),
    (b'"id": 3,\n', b'"id": 3, \n'),  # whitespace: the checksum covers the text as written
])
def test_manifest_edit_that_still_parses_is_caught(storage, old, new):
    raw = seal(BODY)
    assert raw.count(old) == 1
    bad = raw.replace(old, new)
    json.loads(bad)  # still valid JSON
    storage.write(manifest_path(3), bad)
    with pytest.raises(CorruptCheckpointError, match="does not match its checksum") as e:
        load_manifest(storage, 3)
    assert e.value.path == manifest_path(3) and manifest_path(3) in str(e.value)


def test_manifest_with_a_flipped_checksum_digit(storage):
    doc = json.loads(seal(BODY))
    doc["xxh3"] = ("0" if doc["xxh3"][0] != "0" else "1") + doc["xxh3"][1:]
    storage.write(manifest_path(3), json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        load_manifest(storage, 3)


@pytest.mark.parametrize("cut", [1, 10, 100])
def test_truncated_manifest(storage, cut):
    raw = seal(BODY)
    storage.write(manifest_path(3), raw[:-cut])
    with pytest.raises(CorruptCheckpointError, match="is not valid JSON") as e:
        load_manifest(storage, 3)
    assert e.value.path == manifest_path(3) and manifest_path(3) in str(e.value)


def test_manifest_that_is_not_utf8(storage):
    storage.write(manifest_path(3), b"\xff\xfe\x00garbage")
    with pytest.raises(CorruptCheckpointError) as e:
        load_manifest(storage, 3)
    assert e.value.path == manifest_path(3)


def test_manifest_of_another_checkpoint(storage):
    storage.write(manifest_path(4), seal(BODY))
    with pytest.raises(CorruptCheckpointError, match="describes checkpoint 3, not 4") as e:
        load_manifest(storage, 4)
    assert e.value.path == manifest_path(4)


@pytest.mark.parametrize("doc", [[1, 2], {"format": "other", "version": 1, "body": {}}, {"format": "cnr-checkpoint"}])
def test_not_a_manifest(storage, doc):
    storage.write(manifest_path(3), json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpointError, match="not a cnr_torchrec manifest"):
        load_manifest(storage, 3)


@pytest.mark.parametrize("version", [1, 7, 0, None, "2"])
def test_manifest_version_mismatch(storage, version):
    doc = json.loads(seal(BODY))
    doc["version"] = version
    storage.write(manifest_path(3), json.dumps(doc).encode())
    with pytest.raises(CorruptCheckpointError) as e:
        load_manifest(storage, 3)
    assert f"format version {version!r}" in str(e.value) and "reads versions 2 to 6" in str(e.value)
    assert ("earlier cnr_torchrec" if version == 1 else "upgrade cnr_torchrec") in str(e.value)
    assert e.value.path == manifest_path(3)


@pytest.mark.parametrize("version", [3, 4, 5])
def test_older_manifests_still_load(storage, version):
    storage.write(manifest_path(3), seal(BODY, version=version))
    assert read_body(storage, 3) == BODY


def test_missing_manifest(storage):
    with pytest.raises(CheckpointNotFoundError, match=r"ckpt-00000005/manifest.json does not exist"):
        load_manifest(storage, 5)


def _commit(storage, *ids):
    for i in ids:
        storage.write(manifest_path(i), seal({"id": i}))


def test_committed_ids_on_a_listing_backend(storage):
    _commit(storage, 0, 2, 11)
    storage.write(rank_file(1, 0), b"payload of a save that never committed")
    storage.write("ckpt-12/manifest.json", b"{}")  # not an id directory
    storage.write("other/manifest.json", b"{}")
    storage.write("ckpt-00000005", b"a file, not a directory")
    assert committed_ids(storage) == [0, 2, 11]


def test_committed_ids_on_a_non_listing_backend(storage):
    _commit(storage, 0, 1, 2)
    storage.local_dir = None
    assert committed_ids(storage) == [0, 1, 2]  # no index: scan from 0


def test_committed_ids_non_listing_uses_the_index(storage):
    _commit(storage, 3, 4, 6, 7, 8, 1)
    write_index(storage, [3, 4, 5, 6])  # 5 was collected after the index was written; 7, 8 are newer
    storage.local_dir = None
    assert committed_ids(storage) == [3, 4, 6, 7, 8]  # 1 is not in the index: invisible without listing
    storage.delete(manifest_path(8))
    storage.delete(manifest_path(7))
    assert committed_ids(storage) == [3, 4, 6]


def test_write_index_is_sorted_json(storage, tmp_path):
    write_index(storage, [5, 1, 3])
    assert json.loads((tmp_path / "root" / INDEX).read_bytes()) == {"format": "cnr-index", "committed": [1, 3, 5]}


@pytest.mark.parametrize("text", [b"not json", b"[1, 2]", b'{"committed": ["x"]}', b'{"committed": 5}'])
def test_corrupt_index(storage, text):
    _commit(storage, 0)
    storage.write(INDEX, text)
    storage.local_dir = None
    with pytest.raises(CorruptCheckpointError, match="index.json is corrupt") as e:
        committed_ids(storage)
    assert e.value.path == INDEX


def test_corrupt_index_on_a_non_listing_backend_says_how_to_repair_it(storage):
    """Without listing, the index is the only catalog once garbage collection has made gaps:
    the error says to rewrite it (deleting it would hide checkpoints 3..5), and a rewritten
    index finds them again."""
    _commit(storage, 3, 4, 5)
    storage.write(INDEX, b"not json")
    storage.local_dir = None
    with pytest.raises(CorruptCheckpointError, match="rewrite it") as e:
        committed_ids(storage)
    assert "delete" not in str(e.value) and e.value.path == INDEX
    write_index(storage, [3, 4, 5])
    assert committed_ids(storage) == [3, 4, 5]


# ---- row ids -------------------------------------------------------------------------


@pytest.mark.parametrize("num_rows,count", [(0, 0), (1, 0), (1, 1), (31, 1), (32, 1), (33, 1), (64, 2), (65, 2),
                                            (100, 3), (100, 4), (1000, 31), (1000, 32), (1000, 1000),
                                            (4096, 128), (4097, 128), (10**5, 7)])
def test_row_id_encoding(num_rows, count):
    """Both kinds round-trip; the one chosen is never bigger than the other."""
    g = torch.Generator().manual_seed(num_rows * 7 + count)
    ids = torch.randperm(num_rows, generator=g)[:count].sort().values
    kind, blob = encode_ids(ids, num_rows)
    bitmap_bytes, list_bytes = (num_rows + 7) // 8, 4 * count
    assert kind == ("bitmap" if bitmap_bytes <= list_bytes else "list")
    assert blob.numel() * blob.element_size() == min(bitmap_bytes, list_bytes)
    assert blob.dtype == (torch.uint8 if kind == "bitmap" else torch.int32)
    back = decode_ids(kind, blob, num_rows)
    assert back.dtype == torch.int64 and torch.equal(back, ids)
    # The other kind, built by hand, decodes to the same ids.
    mask = torch.zeros(num_rows, dtype=torch.bool)
    mask[ids] = True
    bits = torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    assert torch.equal(decode_ids("bitmap", bits, num_rows), ids)
    assert torch.equal(decode_ids("list", ids.to(torch.int32), num_rows), ids)


def test_bitmap_bit_order():
    """Row r is bit r % 8 of byte r // 8."""
    kind, blob = encode_ids(torch.tensor([0, 9, 15]), 16)
    assert kind == "bitmap" and blob.tolist() == [0b00000001, 0b10000010]


def test_unknown_id_encoding():
    with pytest.raises(ValueError, match="'rle'"):
        decode_ids("rle", torch.zeros(1, dtype=torch.uint8), 8)


# ---- rng state -----------------------------------------------------------------------


def _draws():
    return (torch.rand(5).tolist(), torch.randint(0, 1000, (3,)).tolist(), random.random(), random.gauss(0, 1),
            np.random.rand(3).tolist(), np.random.randn(1).tolist())


@pytest.mark.parametrize("through_storage", [False, True])
def test_rng_state_round_trip(storage, through_storage):
    """Draw, save, draw, restore, draw again: the two draws after the save agree in every stream."""
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    _draws()  # leaves a cached gaussian in python's and numpy's generators
    state = rng_state()
    if through_storage:
        state = round_trip(storage, state)
    first = _draws()
    _draws()
    set_rng_state(state)
    assert _draws() == first


# ---------------------------------------------------------------------- dense optimizer by name


def _adam_after_a_step(model):
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    return opt


def test_dense_optimizer_state_follows_parameter_names():
    from cnr_torchrec.ckpt.format.dense_optim_named import load_named_state, named_state

    torch.manual_seed(0)
    saved_model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    saved = named_state(saved_model, _adam_after_a_step(saved_model))
    assert saved["param_names"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    # The same parameters in another order, and one the checkpoint does not know.
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model.extra = torch.nn.Parameter(torch.zeros(5))
    opt = torch.optim.Adam([model[1].weight, model.extra, model[0].bias, model[0].weight, model[1].bias], lr=0.5)
    load_named_state(model, opt, saved, "checkpoint 1")
    by_name = dict(zip(saved["param_names"], range(4)))
    for name, p in [("1.weight", model[1].weight), ("0.bias", model[0].bias), ("0.weight", model[0].weight)]:
        assert torch.equal(opt.state[p]["exp_avg"], saved["state"][by_name[name]]["exp_avg"]), name
    assert model.extra not in opt.state  # fresh
    assert opt.param_groups[0]["lr"] == 0.01  # the saved group's hyperparameters


def test_dense_optimizer_state_errors_are_named():
    from cnr_torchrec.ckpt.format.dense_optim_named import load_named_state, named_state, param_names

    model = torch.nn.Linear(3, 4)
    saved = named_state(model, _adam_after_a_step(model))
    other = torch.nn.Linear(3, 5)  # same names, other shapes
    with pytest.raises(IncompatibleCheckpointError, match="'weight' is \\[4, 3\\] in the checkpoint"):
        load_named_state(other, torch.optim.Adam(other.parameters()), saved, "checkpoint 1")
    positional = {k: v for k, v in saved.items() if k != "param_names"}  # a checkpoint written before the names
    with pytest.raises(IncompatibleCheckpointError, match="does not match the one saved"):
        load_named_state(other, torch.optim.Adam([other.weight]), positional, "checkpoint 1")
    with pytest.raises(ConfigError, match="not in the model"):
        param_names(model, torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))]))


@pytest.mark.parametrize("failed, why", [
    ([], "give the ranks that failed"),
    ([1], "give the ranks that failed"),  # outside a world of one rank
    ([-1], "give the ranks that failed"),
    ([0], "every rank failed"),
])
def test_recover_refuses_failed_ranks_that_leave_nothing_to_recover_from(group, tmp_path, failed, why):
    from _toy import build_dmp

    from cnr_torchrec import Checkpointer, load_config
    from cnr_torchrec.errors import ConfigError
    from examples.toy import TableSpec

    dmp, opt = build_dmp([TableSpec("t0", 40, 4, "table_wise", "ebc")])
    with Checkpointer(dmp, load_config({"root": str(tmp_path)}), dense_optimizer=opt) as ck:
        ck.save(1).wait()
        with pytest.raises(ConfigError, match=why):
            ck.recover(failed)
        assert ck.list()[-1].step == 1  # nothing was touched


def test_a_restore_says_where_its_time_went(group, tmp_path):
    """last_restore_stats: every phase of restore/stats.py timed once the chain is applied, the top-level
    phases adding up to no more than the restore's own wall time, and the bytes read those of the files."""
    import time

    from _toy import build_dmp, train

    from cnr_torchrec import Checkpointer, load_config
    from cnr_torchrec.ckpt.restore.stats import PHASES
    from examples.toy import TableSpec

    specs = [TableSpec("t0", 400, 8, "table_wise", "ebc"), TableSpec("t1", 300, 4, "row_wise", "ebc")]
    dmp, opt = build_dmp(specs)
    config = load_config({"root": str(tmp_path), "policy": "consecutive"})
    gen = torch.Generator().manual_seed(0)
    with Checkpointer(dmp, config, dense_optimizer=opt) as ck:
        for step in (1, 2, 3):
            train(dmp, specs, opt, 1, gen)
            ck.save(step).wait()
        assert ck.last_restore_stats == {}
        t0 = time.perf_counter()
        assert ck.restore() == 3
        wall_ms = (time.perf_counter() - t0) * 1e3
        stats = ck.last_restore_stats
    assert set(stats) <= set(PHASES) | {"bytes_read", "reads", "minimal_bytes"}, stats
    for phase in ("resolve_ms", "manifests_ms", "check_ms", "plan_ms", "apply_ms", "state_ms", "agree_ms"):
        assert stats.get(phase, 0) > 0, (phase, stats)
    top = ("resolve_ms", "check_ms", "plan_ms", "apply_ms", "state_ms", "agree_ms")  # disjoint parts of the restore
    assert sum(stats[p] for p in top) <= wall_ms, (stats, wall_ms)
    assert stats["manifests_ms"] <= stats["resolve_ms"] and stats.get("read_wait_ms", 0) <= stats["apply_ms"]
    files = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(tmp_path) for f in fs
                if f.startswith("rank-"))
    assert 0 < stats["minimal_bytes"] <= stats["bytes_read"] <= files and stats["reads"] > 0


def test_minimal_bytes_of_a_baseline_are_its_rows_as_stored(group, tmp_path):
    """A restore of one baseline applies every stored row: its minimal bytes are the weight and optimizer-state
    blobs of every entry the manifest lists, with their CRCs (ids, dense and RNG state left out)."""
    from _toy import build_dmp, train

    from cnr_torchrec import Checkpointer, load_config
    from cnr_torchrec.ckpt.format.commits import load_manifest
    from cnr_torchrec.ckpt.format.storage import Storage
    from examples.toy import TableSpec

    specs = [TableSpec("t0", 400, 8, "table_wise", "ebc"), TableSpec("t1", 300, 4, "column_wise", "ebc"),
             TableSpec("t2", 50, 4, "data_parallel", "ebc")]
    dmp, opt = build_dmp(specs)
    with Checkpointer(dmp, load_config({"root": str(tmp_path), "policy": "full"}), dense_optimizer=opt) as ck:
        train(dmp, specs, opt, 1, torch.Generator().manual_seed(0))
        info = ck.save(1).wait()
        ck.restore()
        stats = ck.last_restore_stats
    storage = Storage(str(tmp_path))
    m = load_manifest(storage, info.id)
    storage.close()
    want = 0
    for report, _, e in m.entries():
        want += sum(report.blobs[n].nbytes for n in [*e.weights.blobs.values(), *(s.blob for s in e.states),
                                                       e.checks.blob])
    for report in m.ranks:
        want += sum(report.blobs[n].nbytes for n in report.replicated_tables.values())
    assert m.replicated and stats["minimal_bytes"] == want, (stats, want)
