"""A rank's payload blobs and state trees (format/bytes/payload.py): every dtype round-trips, flipped bytes and
truncation are caught, optimizer and scheduler state flatten without pickle, and what needs pickle is refused."""

from __future__ import annotations

import json
import math

import pytest
import torch
from _format_checks import range_read, round_trip, xxh3_reference

from cnr_torchrec.ckpt.format.commits import (
    manifest_path,
    read_body,
    seal,
)
from cnr_torchrec.ckpt.format.bytes.payload import BlobWriter, flatten_state, read_blob, unflatten_state
from cnr_torchrec.ckpt.format.schema import check_payload
from cnr_torchrec.errors import (
    CheckpointError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)

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
        got = range_read(storage, "p.bin", index, name)
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
        range_read(storage, file, index, "a")
    assert e.value.path == file and file in str(e.value)
    assert torch.equal(range_read(storage, file, index, "b"), torch.ones(3))  # the other blob is fine


@pytest.mark.parametrize("keep", [0, 5, 51])
def test_read_blob_detects_truncation(storage, keep):
    file, data, index = _written(storage, {"a": torch.ones(3), "b": torch.arange(10, dtype=torch.float32)})
    storage.write(file, data[:keep])
    with pytest.raises(CorruptCheckpointError, match="truncated") as e:
        range_read(storage, file, index, "b")
    assert e.value.path == file and file in str(e.value)


def test_read_blob_refuses_an_unknown_dtype(storage):
    file, _, index = _written(storage, {"a": torch.ones(3)})
    with pytest.raises(UnsafeCheckpointError, match="object"):
        range_read(storage, file, {"a": {**index["a"], "dtype": "object"}}, "a")


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
