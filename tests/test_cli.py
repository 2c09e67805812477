"""The ``cnr`` command line, and the example job's ``python -m cnr_dlrm.report``, on checkpoints written by
the real Checkpointer.

References are independent of the code under test: the manifests read as plain JSON and
the CheckpointInfo the Checkpointer returned (inspect, report), bytes flipped or cut by
hand (verify), the model restored from the original chain by ``Checkpointer.restore``
(compact, export), an unsharded torchrec model (export) and the codec applied directly
(quantized compaction).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from _dist import run_ranks
from _toy import build_dmp, local_state, train

ROWS, DIM = 48, 8
PLAN = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------- model and roots


class Counter:
    """A tiny Stateful (a reader position), so extra_state travels through compaction."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self):
        return {"n": torch.tensor([self.n]), "name": "counter"}

    def load_state_dict(self, state):
        self.n = int(state["n"][0])


def _build(world_size, seed=0):
    from examples.toy import TableSpec

    specs = [TableSpec(f"t{i}", ROWS, DIM, st, "ebc") for i, st in enumerate(PLAN)]
    dmp, opt = build_dmp(specs, seed=seed)
    return dmp, specs, opt


_train = train


def _config(root, method, bits):
    from cnr_torchrec import load_config

    # Plain coding: exports are the codec's image of the live rows (residual chains: test_residual.py).
    return load_config({"root": root, "policy": "consecutive",
                        "quantization": {"method": method, "bits": bits, "residual": False}, "keep_last": 5,
                        "restore_rng": True})  # the RNG a chain restores is compared with its export's


def _write_chain(root, method, bits, saves, world_size=1, rank=0):
    """A baseline and ``saves - 1`` consecutive deltas. Returns the CheckpointInfos and the live model."""
    from cnr_torchrec import Checkpointer

    dmp, specs, opt = _build(world_size)
    counter = Counter()
    ckpt = Checkpointer(dmp, _config(root, method, bits), dense_optimizer=opt, extra_state={"counter": counter})
    gen = torch.Generator().manual_seed(3 + rank)
    infos = []
    for step in range(1, saves + 1):
        _train(dmp, specs, opt, 2, gen)
        counter.n = 10 * step
        infos.append(ckpt.save(step).wait())
    ckpt.close()
    return infos, dmp, specs


def _local_state(dmp, opt=None, counter=None):
    """This rank's shards (weights and optimizer states), dense parameters, dense optimizer, TBE steps, extra."""
    out = local_state(dmp)
    for i, tbe in enumerate(dmp.dirty_tracker.tbes()):
        if isinstance(getattr(tbe, "iter", None), torch.Tensor):
            out[("iter", i)] = tbe.iter.clone()
    if opt is not None:
        for i, st in opt.state_dict()["state"].items():
            for k, v in st.items():
                out[("adam", i, k)] = v.clone()
    if counter is not None:
        out["counter"] = torch.tensor([counter.n])
    return out


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (k, (a[k].float() - b[k].float()).abs().max())


def _restore(root, seed, method="none", bits=None, per_rank=True):
    """A differently initialised model with ``root`` restored by the real Checkpointer.

    ``per_rank=False`` leaves out the per-rank extra state (for a checkpoint of another world size).
    """
    from cnr_torchrec import Checkpointer

    dmp, specs, opt = _build(1, seed=seed)
    counter = Counter() if per_rank else None
    ckpt = Checkpointer(dmp, _config(root, method, bits), dense_optimizer=opt,
                        extra_state={"counter": counter} if per_rank else {})
    step = ckpt.restore()
    after = torch.rand(4)  # the restored RNG's next draws
    ckpt.close()
    return step, dmp, specs, _local_state(dmp, opt, counter), after


def _full_tables(dmp):
    """Whole tables of a world-size-1 model from its shards: weights and the row-wise Adagrad state.

    A column shard keeps its own mean of squared gradients; the unsharded row's value is the
    column-width-weighted mean over the shards.
    """
    tracker = dmp.dirty_tracker
    out = {}
    for t in tracker.tables():
        w = torch.zeros(ROWS, DIM)
        m = torch.zeros(ROWS, dtype=torch.float64)
        for k, s in tracker.shards(t):
            w[s.rows[0]:s.rows[1], s.cols[0]:s.cols[1]] = k.tbe.split_embedding_weights()[s.local_index]
            if not tracker.is_data_parallel(t):
                state = k.tbe.split_optimizer_states()[s.local_index][0].reshape(-1).double()
                m[s.rows[0]:s.rows[1]] += state * (s.cols[1] - s.cols[0]) / DIM
        out[t] = (w, None if tracker.is_data_parallel(t) else m)
    return out


def _manifest(root, cid):
    """Checkpoint ``cid``'s manifest as one JSON body, its ranks' reports under ``ranks``."""
    from _format_checks import combined_body

    from cnr_torchrec.ckpt.format.bytes.storage import Storage

    storage = Storage(root)
    try:
        return combined_body(storage, cid)
    finally:
        storage.close()


def _flip(path, pos, mask=0x01):
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ mask]))


@pytest.fixture(scope="module")
def roots(group, tmp_path_factory):
    """Two roots of one rank: adaptive 4-bit (a baseline and 3 deltas) and fp32 (a baseline and 2 deltas)."""
    base = tmp_path_factory.mktemp("roots")
    q, n = str(base / "adaptive4"), str(base / "none")
    q_infos, q_dmp, _ = _write_chain(q, "adaptive", 4, saves=4)
    n_infos, n_dmp, _ = _write_chain(n, "none", None, saves=3)
    tracker = q_dmp.dirty_tracker
    sharded = [t for t in tracker.tables() if not tracker.is_data_parallel(t)]
    held = sum(r1 - r0 for t in sharded for (r0, r1), _ in tracker.shard_ranges(t))
    states = sum((r1 - r0) * 4 for t in sharded for (r0, r1), _ in tracker.shard_ranges(t))
    return {"q": q, "n": n, "q_infos": q_infos, "n_infos": n_infos, "held_rows": held,
            "full_nbytes": len(tracker.tables()) * ROWS * DIM * 4 + states, "n_live": _full_tables(n_dmp)}


def _copy(src, tmp_path, name="copy"):
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def _run(capsys, *argv):
    from cnr_torchrec.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _report(capsys, *argv):
    """``python -m cnr_dlrm.report ARGV``, in this process."""
    from cnr_dlrm.report import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------- inspect


@pytest.mark.timeout(60)
def test_inspect_json_and_text_match_the_manifests(roots, tmp_path, capsys):
    root = _copy(roots["q"], tmp_path)
    os.makedirs(os.path.join(root, "ckpt-00000009"))  # a save that never committed
    with open(os.path.join(root, "ckpt-00000009", "rank-00000.bin"), "wb") as f:
        f.write(b"x" * 100)

    code, out, _ = _run(capsys, "inspect", root, "--json")
    assert code == 0
    doc = json.loads(out)
    infos = roots["q_infos"]
    assert [r["id"] for r in doc["checkpoints"]] == [i.id for i in infos] == [0, 1, 2, 3]
    for row, info in zip(doc["checkpoints"], infos):
        body = _manifest(root, info.id)
        assert (row["step"], row["kind"], tuple(row["chain"]), row["parent"]) == (
            info.step, info.kind, info.chain, info.parent)
        assert (row["method"], row["bits"]) == (body["codec"]["method"], body["codec"]["bits"]) == ("adaptive", 4)
        on_disk = sum(os.path.getsize(os.path.join(root, r["file"])) for r in body["ranks"])
        assert row["nbytes"] == info.nbytes == on_disk
        assert row["rows_written"] == info.rows_written
        assert row["total_rows"] == roots["held_rows"]
        assert row["dirty_fraction"] == pytest.approx(info.rows_written / roots["held_rows"])
        assert (row["stall_ms"], row["write_ms"]) == (info.stall_ms, info.write_ms)
    assert doc["checkpoints"][0]["dirty_fraction"] == 1.0 and doc["checkpoints"][0]["kind"] == "baseline"
    assert all(0 < r["dirty_fraction"] < 1 for r in doc["checkpoints"][1:])
    assert doc["full_snapshot_nbytes"] == roots["full_nbytes"]
    assert doc["total_nbytes"] == sum(i.nbytes for i in infos)
    assert doc["uncommitted"] == [{"id": 9, "files": {"ckpt-00000009/rank-00000.bin": 100}}]

    code, out, _ = _run(capsys, "inspect", root)
    assert code == 0
    lines = out.splitlines()
    for info in infos:
        chain = f"{info.chain[0]}..{info.id} ({len(info.chain)})"
        assert any(" ".join(line.split()[:6]) == f"{info.id} {info.step} {info.kind} consecutive {chain}"
                   for line in lines), (info, out)
    assert "baseline 0 (step 1): 3 delta(s) 1..3, the newest 3 (step 4) restores 4 checkpoint(s);" in out
    assert "uncommitted (torn): ckpt-00000009" in out
    assert "in 4 checkpoint(s)" in out


@pytest.mark.timeout(60)
def test_inspect_does_not_claim_a_chain_restores_when_a_member_is_corrupt(roots, tmp_path, capsys):
    root = _copy(roots["q"], tmp_path)  # baseline 0, deltas 1..3, each on the one before
    _flip(os.path.join(root, "ckpt-00000002", "manifest.json"), 200)

    code, out, _ = _run(capsys, "inspect", root, "--json")
    assert code == 0
    doc = json.loads(out)
    assert [c["id"] for c in doc["corrupt"]] == [2]
    assert {r["id"]: r["broken_member"] for r in doc["checkpoints"]} == {0: None, 1: None, 3: 2}

    code, out, _ = _run(capsys, "inspect", root)
    assert code == 0
    assert "restores 4 checkpoint(s)" not in out
    assert ("the newest 3 (step 4) cannot be restored: checkpoint 2 of its chain is corrupt (below); the newest "
            "that restores is 1 (step 2, 2 checkpoint(s))") in out
    assert any(line.split()[:5] == ["3", "4", "delta", "consecutive", "0..3"] and "broken" in line
               for line in out.splitlines()), out

    # The baseline's manifest corrupt too: no delta restores, and none is said to.
    _flip(os.path.join(root, "ckpt-00000000", "manifest.json"), 200)
    code, out, _ = _run(capsys, "inspect", root)
    assert code == 0 and "restores" not in out.replace("restore ignores", "")
    assert "delta 3 hangs on baseline 0, which is corrupt (below) (it cannot be restored)" in out


def test_inspect_marks_a_committed_checkpoint_whose_file_is_gone_and_names_what_restores(roots, tmp_path, capsys):
    """An existence check (issue 43): a committed delta whose rank file the storage lost is marked, and the
    checkpoint a restore takes instead is named, as the restore's own resolver finds it."""
    root = _copy(roots["q"], tmp_path)  # baseline 0, deltas 1..3, each on the one before
    os.unlink(os.path.join(root, "ckpt-00000002", "rank-00000.bin"))
    code, out, _ = _run(capsys, "inspect", root, "--json")
    assert code == 0
    doc = json.loads(out)
    assert {r["id"]: r["missing_files"] for r in doc["checkpoints"]} == {
        0: [], 1: [], 2: ["ckpt-00000002/rank-00000.bin"], 3: []}
    assert doc["newest_restorable"] == 1
    assert [u["id"] for u in doc["unrestorable"]] == [2]  # unsound itself; delta 3 hangs on it
    code, out, _ = _run(capsys, "inspect", root)
    assert code == 0
    assert "missing: checkpoint 2: ckpt-00000002/rank-00000.bin is not there" in out
    assert "a restore takes checkpoint 1; it finds unsound checkpoint 2" in out


# ---------------------------------------------------------------------- verify


@pytest.mark.timeout(60)
def test_verify_passes_a_sound_root_and_names_every_damaged_file(roots, tmp_path, capsys):
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.tools.verify import Problem, verify_checkpoint, verify_root

    root = _copy(roots["q"], tmp_path)
    assert verify_root(root) == []
    code, out, _ = _run(capsys, "verify", root)
    assert code == 0 and out.startswith("OK")

    gen = torch.Generator().manual_seed(0)
    for rel in ("ckpt-00000002/manifest.json", "ckpt-00000001/rank-00000.bin", "index.json"):
        path = os.path.join(root, rel)
        size = os.path.getsize(path)
        positions = {0, size // 2, size - 1} | set(torch.randint(0, size, (6,), generator=gen).tolist())
        for pos in sorted(positions):
            for mask in (0x01, 0x80):
                _flip(path, pos, mask)
                problems = verify_root(root)
                _flip(path, pos, mask)
                assert problems and all(isinstance(p, Problem) for p in problems)
                assert any(p.path == rel for p in problems), (rel, pos, mask, problems)
        assert verify_root(root) == []

    # A damaged baseline breaks every delta that hangs on it; the CLI prints the file and exits 1.
    baseline_file = "ckpt-00000000/rank-00000.bin"
    _flip(os.path.join(root, baseline_file), 100)
    problems = verify_root(root, ids=[3])
    assert Problem(0, baseline_file, "does not match its xxh3 in the manifest (its bytes changed)") not in problems
    assert any(p.ckpt_id == 3 and p.path == baseline_file and "needs checkpoint 0" in p.message for p in problems)
    storage = Storage(root)
    assert any(p.ckpt_id == 0 and p.path == baseline_file for p in verify_checkpoint(storage, 0))
    storage.close()
    code, out, _ = _run(capsys, "verify", root)
    assert code == 1 and f"PROBLEM {baseline_file}:" in out
    _flip(os.path.join(root, baseline_file), 100)

    # Truncation, and a missing file.
    victim = os.path.join(root, "ckpt-00000003", "rank-00000.bin")
    data = open(victim, "rb").read()
    with open(victim, "wb") as f:
        f.write(data[:-7])
    problems = verify_root(root)
    assert any(p.path == "ckpt-00000003/rank-00000.bin" and "truncated" in p.message for p in problems)
    code, out, _ = _run(capsys, "verify", root, "--id", "3")
    assert code == 1 and "ckpt-00000003/rank-00000.bin" in out and "truncated" in out
    os.remove(victim)
    assert any(p.path == "ckpt-00000003/rank-00000.bin" and "missing" in p.message for p in verify_root(root))
    with open(victim, "wb") as f:
        f.write(data)
    assert verify_root(root) == []


@pytest.mark.timeout(60)
def test_verify_count_adds_up_with_the_lines_it_prints(roots, tmp_path, capsys):
    from cnr_torchrec.ckpt.tools.verify import verify_root

    root = _copy(roots["q"], tmp_path)
    victim = os.path.join(root, "ckpt-00000000", "rank-00000.bin")
    for pos in range(0, os.path.getsize(victim), 97):  # damage every blob: more problems than a file lists
        _flip(victim, pos)
    problems = verify_root(root)
    assert not any(p.message.startswith("...") for p in problems)  # the library lists every problem
    code, out, _ = _run(capsys, "verify", root)
    assert code == 1
    lines = out.splitlines()
    listed = sum(line.startswith("PROBLEM ") for line in lines)
    more = [int(line.split()[2]) for line in lines if line.startswith("... and ")]
    assert more and listed + sum(more) == len(problems)  # some lines stand for several problems
    assert lines[-1] == f"{len(problems)} problem(s) in checkpoint(s) 0, 1, 2, 3"
    assert len(lines) == listed + len(more) + 1


# ---------------------------------------------------------------------- compact


@pytest.mark.timeout(90)
def test_compact_then_restore_equals_restoring_the_chain(roots, tmp_path, capsys):
    root = _copy(roots["q"], tmp_path)
    step, _, _, chain_state, chain_rng = _restore(root, seed=1)
    assert step == 4

    code, out, _ = _run(capsys, "compact", root)
    assert code == 0 and "into baseline 4" in out and "lossless" in out
    tip, new = _manifest(root, 3), _manifest(root, 4)
    assert (new["kind"], new["base"], new["depth"], new["step"], new["world_size"]) == ("baseline", 4, 0, 4, 1)
    assert new["compacted_from"] == [0, 3] and new["equals"] == 3 and new["codec"] == tip["codec"]
    # Every row once: as many stored rows as the tables' shards hold, each kept as the chain stored it.
    assert sum(r["rows_written"] for r in new["ranks"]) == sum(
        e["rows"][1] - e["rows"][0] for es in _manifest(root, 0)["ranks"][0]["tables"].values() for e in es) + sum(
        _manifest(root, 0)["tables"][t][0] for t in _manifest(root, 0)["replicated"])
    with open(os.path.join(root, "index.json")) as f:
        assert json.load(f)["committed"] == [0, 1, 2, 3, 4]
    code, _, _ = _run(capsys, "verify", root)
    assert code == 0

    # The compacted baseline alone restores the same state, bit for bit.
    for cid in range(4):
        shutil.rmtree(os.path.join(root, f"ckpt-{cid:08d}"))
    step, _, _, got, got_rng = _restore(root, seed=2)
    assert step == 4
    _assert_same(got, chain_state)
    assert torch.equal(got_rng, chain_rng)
    assert int(got["counter"][0]) == 40


@pytest.mark.timeout(90)
def test_quantized_compaction_equals_the_codec_applied_to_the_chain(roots, tmp_path, capsys):
    from cnr_torchrec.quant import get_codec

    root = _copy(roots["n"], tmp_path)
    _, _, _, chain_state, _ = _restore(root, seed=1)
    code, _, _ = _run(capsys, "compact", root, "--id", "2", "--method", "uniform_asym", "--bits", "8")
    assert code == 0
    assert _manifest(root, 3)["codec"]["method"] == "uniform_asym"
    _, dmp, _, got, _ = _restore(root, seed=2)
    codec = get_codec("uniform_asym", 8)
    for key, ref in chain_state.items():
        if isinstance(key, tuple) and key[-1] == "w" and not dmp.dirty_tracker.is_data_parallel(key[0]):
            ref = codec.decode(codec.encode(ref.float()))  # each shard was written whole, row by row
        assert torch.equal(got[key], ref), key


# ---------------------------------------------------------------------- export


@pytest.mark.timeout(90)
def test_export_loads_with_weights_only_into_an_unsharded_model(roots, tmp_path, capsys):
    from examples.toy import ToyModel, zipf_batch

    out_file = str(tmp_path / "export.pt")
    code, out, _ = _run(capsys, "export", roots["q"], "--out", out_file, "--id", "3")
    assert code == 0 and "exported checkpoint 3" in out
    state = torch.load(out_file, weights_only=True)
    assert all(isinstance(v, torch.Tensor) for v in state.values())

    _, dmp, specs, _, _ = _restore(roots["q"], seed=1)
    full = _full_tables(dmp)
    fqns = _manifest(roots["q"], 3)["table_fqns"]
    for t, (w, m) in full.items():
        assert torch.equal(state[fqns[t]], w), t
        if m is not None:
            torch.testing.assert_close(state[f"{fqns[t]}.optimizer_state.0"].double(), m, rtol=1e-6, atol=0)
        else:
            assert f"{fqns[t]}.optimizer_state.0" not in state
    for n, p in dmp.named_parameters():
        if n.startswith("dense"):
            assert torch.equal(state[n], p.detach())

    plain = ToyModel(specs, device="cpu")
    result = plain.load_state_dict(state, strict=False)
    assert result.missing_keys == []
    assert all(".optimizer_state." in k or k == "_unused" for k in result.unexpected_keys)
    for name, p in plain.named_parameters():
        assert torch.equal(p.detach(), state[name])
    with torch.no_grad():
        batch = zipf_batch(specs, batch_size=8, pooling=3, generator=torch.Generator().manual_seed(9))
        torch.testing.assert_close(plain(batch), dmp(batch), rtol=1e-5, atol=1e-6)

    # fp32 chain: the export is the live model at the last save, exactly.
    out_file = str(tmp_path / "export-fp32.pt")
    code, _, _ = _run(capsys, "export", roots["n"], "--out", out_file)
    assert code == 0
    state = torch.load(out_file, weights_only=True)
    for t, (w, _) in roots["n_live"].items():
        assert torch.equal(state[fqns[t]], w), t


@pytest.mark.timeout(60)
def test_export_refuses_an_existing_out_and_a_missing_directory(roots, tmp_path, capsys):
    existing = tmp_path / "existing.pt"
    existing.write_bytes(b"keep me")
    (tmp_path / "existing_dir").mkdir()
    cases = [
        (["--out", str(existing)], f"{existing} exists; give --out a new file (an export never overwrites)"),
        (["--out", str(tmp_path / "existing_dir"), "--format", "dcp"], "exists; give --out a new directory"),
        (["--out", str(tmp_path / "no" / "x.pt")], f"the directory of --out {tmp_path / 'no' / 'x.pt'} "
                                                    f"({tmp_path / 'no'}) does not exist; create it"),
        (["--out", str(tmp_path / "no" / "x"), "--format", "dcp"], "does not exist; create it"),
    ]
    for argv, message in cases:
        code, out, err = _run(capsys, "export", roots["q"], *argv)
        assert code == 2 and out == "", (argv, code, out, err)
        assert err.startswith("cnr export: ConfigError: ") and message in err, (argv, err)
        assert len(err.strip().splitlines()) == 1, err
    assert existing.read_bytes() == b"keep me" and os.listdir(tmp_path / "existing_dir") == []
    assert not (tmp_path / "no").exists()


# ---------------------------------------------------------------------- two ranks


def _two_rank_worker(rank, world_size, root):
    _write_chain(root, "adaptive", 4, saves=3, world_size=world_size, rank=rank)


@pytest.mark.multirank
@pytest.mark.timeout(180)
def test_two_rank_checkpoint_compacts_and_exports(group, tmp_path, capsys):
    root = str(tmp_path / "two")
    run_ranks(_two_rank_worker, world_size=2, timeout=150, args=(root,))
    tip = _manifest(root, 2)
    assert tip["world_size"] == 2 and (tip["base"], tip["depth"]) == (0, 2)

    _, chain_dmp, _, chain_state, _ = _restore(root, seed=1, per_rank=False)  # 2 ranks onto 1, by the Checkpointer
    out_file = str(tmp_path / "two.pt")
    assert _run(capsys, "export", root, "--out", out_file)[0] == 0
    code, out, _ = _run(capsys, "compact", root)
    assert code == 0 and "in 2 rank file(s)" in out
    new = _manifest(root, 3)
    assert new["world_size"] == 2 and [r["file"] for r in new["ranks"]] == [
        "ckpt-00000003/rank-00000.bin", "ckpt-00000003/rank-00001.bin"]
    for r_new, r_tip in zip(new["ranks"], tip["ranks"]):  # each rank merged the blocks it wrote in the tip
        blocks = lambda r: {(t, c) for t, es in r["tables"].items() for e in es for c in [tuple(e["cols"])]}
        assert blocks(r_new) <= blocks(r_tip) | {(t, (0, tip["tables"][t][1])) for t in tip["replicated"]}
        assert r_new["tbe_iter"] == r_tip["tbe_iter"]
    for cid in range(3):
        shutil.rmtree(os.path.join(root, f"ckpt-{cid:08d}"))
    _, _, _, got, _ = _restore(root, seed=2, per_rank=False)
    _assert_same(got, chain_state)

    state = torch.load(out_file, weights_only=True)
    for t, (w, m) in _full_tables(chain_dmp).items():
        name = tip["table_fqns"][t]
        assert torch.equal(state[name], w), t
        if m is not None:
            torch.testing.assert_close(state[f"{name}.optimizer_state.0"].double(), m, rtol=1e-6, atol=0)


# ---------------------------------------------------------------------- s3


@pytest.mark.timeout(120)
def test_s3_root_through_storage_options(roots, tmp_path, capsys):
    """inspect / verify / compact on an s3:// root (a moto server), configured only by --storage-option."""
    server_mod = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    capsys.readouterr()  # the server announces itself on stdout
    try:
        host, port = server.get_host_and_port()
        opts = {"endpoint_url": f"http://{host}:{port}", "aws_access_key_id": "testing",
                "aws_secret_access_key": "testing", "region_name": "us-east-1"}
        client = boto3.client("s3", **opts)
        client.create_bucket(Bucket="cnr-cli-test")
        for d, _, files in os.walk(roots["q"]):
            for f in files:
                path = os.path.join(d, f)
                client.upload_file(path, "cnr-cli-test", "run/" + os.path.relpath(path, roots["q"]))
        root = "s3://cnr-cli-test/run"
        flags = [a for k, v in opts.items() for a in ("--storage-option", f"{k}={v}")]

        code, out, err = _run(capsys, "inspect", root, "--json", *flags)
        assert code == 0, err
        assert [r["nbytes"] for r in json.loads(out)["checkpoints"]] == [i.nbytes for i in roots["q_infos"]]
        assert _run(capsys, "verify", root, *flags)[0] == 0
        code, out, err = _run(capsys, "compact", root, *flags)
        assert code == 0 and "into baseline 4" in out, err
        assert _run(capsys, "verify", root, *flags)[0] == 0

        key = "run/ckpt-00000004/rank-00000.bin"
        data = bytearray(client.get_object(Bucket="cnr-cli-test", Key=key)["Body"].read())
        data[17] ^= 0x04
        client.put_object(Bucket="cnr-cli-test", Key=key, Body=bytes(data))
        code, out, _ = _run(capsys, "verify", root, *flags)
        assert code == 1 and "ckpt-00000004/rank-00000.bin" in out
        code, _, err = _run(capsys, "inspect", root, "--storage-option", "endpoint=http://x")
        assert code == 2 and "endpoint_url" in err.splitlines()[-1]
    finally:
        server.stop()


# ---------------------------------------------------------------------- report (python -m cnr_dlrm.report)


def _series_from_manifests(root, ids, held_rows):
    bodies = [_manifest(root, i) for i in ids]
    return {
        "ids": ids,
        "nbytes": [b["nbytes"] for b in bodies],
        "steps": [b["step"] for b in bodies],
        "kinds": [b["kind"] for b in bodies],
        "dirty": [sum(r["rows_written"] for r in b["ranks"]) / held_rows for b in bodies],
        "stall": [max(r["stall_ms"] for r in b["ranks"]) for b in bodies],
    }


def _figure_data(figs):
    from cnr_dlrm.plots import PLOTS

    bytes_ax, dirty_ax, stall_ax = (figs[name].axes[0] for name in PLOTS)
    return {
        "nbytes": [p.get_height() for p in bytes_ax.patches],
        "full": [line.get_ydata()[0] for line in bytes_ax.lines],
        "dirty": [tuple(xy) for xy in dirty_ax.collections[0].get_offsets().tolist()],
        "stall": [p.get_height() for p in stall_ax.patches],
        "log": bytes_ax.get_yscale(),
    }


def _check_pngs(out_dir):
    from cnr_dlrm.plots import PLOTS

    for name in PLOTS:
        with open(os.path.join(out_dir, name), "rb") as f:
            data = f.read()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, name


@pytest.mark.timeout(60)
def test_report_from_a_root_plots_the_summary(roots, tmp_path, capsys):
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.tools.summary import summarize
    from cnr_dlrm.plots import build_series, make_figures

    out_dir = str(tmp_path / "plots")
    code, out, _ = _report(capsys, roots["q"], "--out", out_dir)
    assert code == 0 and len(out.splitlines()) == 3
    _check_pngs(out_dir)

    storage = Storage(roots["q"])
    summary = summarize(storage)
    storage.close()
    ref = _series_from_manifests(roots["q"], [0, 1, 2, 3], roots["held_rows"])
    s = build_series(summary)
    assert s["bytes"]["ids"] == s["stall"]["ids"] == ref["ids"]
    assert s["bytes"]["nbytes"] == ref["nbytes"] and s["bytes"]["kinds"] == ref["kinds"]
    assert s["bytes"]["full_snapshot_nbytes"] == roots["full_nbytes"]
    assert s["dirty"]["steps"] == ref["steps"]
    assert s["dirty"]["dirty_fraction"] == pytest.approx(ref["dirty"])
    assert s["stall"]["stall_ms"] == ref["stall"]
    drawn = _figure_data(make_figures(summary))
    assert drawn["nbytes"] == ref["nbytes"] and drawn["full"] == [roots["full_nbytes"]] and drawn["log"] == "log"
    assert [x for x, _ in drawn["dirty"]] == ref["steps"]
    assert [y for _, y in drawn["dirty"]] == pytest.approx(ref["dirty"])
    assert drawn["stall"] == pytest.approx(ref["stall"])


@pytest.mark.timeout(60)
def test_report_from_a_training_report_json(tmp_path, capsys):
    from cnr_dlrm.plots import load_report, make_figures

    rows = [
        {"id": i, "step": 100 * (i + 1), "kind": "baseline" if i % 3 == 0 else "delta", "method": "adaptive",
         "bits": 4 if i else None, "rows_written": 10 * (i + 1), "total_rows": 1000, "dirty_fraction": (i + 1) / 100,
         "nbytes": 5000 + 37 * i, "stall_ms": 1.5 * i, "write_ms": 20.0, "extra_key": "ignored"}
        for i in (2, 0, 1, 3, 4)
    ]
    doc = {"format": "cnr-report", "version": 1, "world_size": 2, "full_snapshot_nbytes": 123456,
           "checkpoints": rows, "restores": 1, "eval": {"logloss": 0.5, "auc": 0.7}, "job": {"anything": True}}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(doc))
    out_dir = str(tmp_path / "plots")
    code, _, _ = _report(capsys, str(path), "--out", out_dir)
    assert code == 0
    _check_pngs(out_dir)
    drawn = _figure_data(make_figures(load_report(str(path))))
    by_id = sorted(rows, key=lambda r: r["id"])
    assert drawn["nbytes"] == [r["nbytes"] for r in by_id] and drawn["full"] == [123456]
    assert drawn["dirty"] == [(r["step"], r["dirty_fraction"]) for r in by_id]
    assert drawn["stall"] == [r["stall_ms"] for r in by_id]


def test_report_without_matplotlib_says_what_to_install(tmp_path, capsys, monkeypatch):
    import sys

    path = tmp_path / "report.json"
    path.write_text(json.dumps({"format": "cnr-report", "version": 1, "world_size": 1, "full_snapshot_nbytes": 1,
                                "checkpoints": [{"id": 0, "step": 1, "kind": "baseline", "method": "none",
                                                 "bits": None, "rows_written": 1, "total_rows": 1,
                                                 "dirty_fraction": 1.0, "nbytes": 1, "stall_ms": 0.0,
                                                 "write_ms": 0.0}]}))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it now raises ImportError
    code, _, err = _report(capsys, str(path), "--out", str(tmp_path / "plots"))
    assert code != 0 and "pip install matplotlib" in err and "`plot` extra" in err
    assert not (tmp_path / "plots").exists()


# ---------------------------------------------------------------------- bad input


@pytest.mark.timeout(60)
def test_bad_inputs_give_one_line_and_a_nonzero_exit(roots, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"format": "cnr-report", "version": 1, "world_size": 1, "full_snapshot_nbytes": 1,
                                 "checkpoints": [{"id": 0, "step": 1, "kind": "baseline", "method": "none",
                                                  "bits": None, "rows_written": 1, "total_rows": 1,
                                                  "dirty_fraction": 1.0, "stall_ms": 0.0, "write_ms": 0.0}]}))
    root = roots["q"]
    cases = [
        (["inspect", str(tmp_path / "missing")], "does not exist"),
        (["inspect", str(empty)], "no checkpoint under"),
        (["verify", str(empty)], "no committed checkpoint"),
        (["verify", os.path.join(root, "ckpt-00000000")], "looks like one checkpoint's directory"),
        (["compact", root, "--id", "42"], "checkpoint 42 is not committed"),
        (["export", root, "--out", str(tmp_path / "x.pt"), "--id", "42"], "checkpoint 42 is not committed"),
        (["verify", root, "--id", "7"], "checkpoint 7 is not committed"),
        (["inspect", root, "--storage-option", "novalue"], "expects KEY=VALUE"),
        (["inspect", "foo://bucket/x"], "cannot open storage"),
        (["compact", root, "--method", "adaptive", "--bits", "5"], "does not support bits=5"),
    ]
    for argv, message in cases:
        code, out, err = _run(capsys, *argv)
        assert code == 2, (argv, code, err)
        assert message in err and "Traceback" not in err, (argv, err)
        assert len(err.strip().splitlines()) == 1, (argv, err)
    assert not (tmp_path / "x.pt").exists()
    code, _, err = _run(capsys, "compact", root, "--id", "notanumber")  # argparse: usage + error
    assert code == 2 and "invalid int value" in err


@pytest.mark.timeout(60)
def test_report_bad_inputs_give_one_line_and_a_nonzero_exit(roots, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"format": "cnr-report", "version": 1, "world_size": 1, "full_snapshot_nbytes": 1,
                                 "checkpoints": [{"id": 0, "step": 1, "kind": "baseline", "method": "none",
                                                  "bits": None, "rows_written": 1, "total_rows": 1,
                                                  "dirty_fraction": 1.0, "stall_ms": 0.0, "write_ms": 0.0}]}))
    cases = [
        ([str(bad_json), "--out", str(tmp_path / "p")], "is not valid JSON"),
        ([str(wrong), "--out", str(tmp_path / "p")], "checkpoints[0].nbytes is missing"),
        ([str(tmp_path / "nope.json"), "--out", str(tmp_path / "p")], "cannot read"),
        ([str(tmp_path / "missing"), "--out", str(tmp_path / "p")], "does not exist"),
        ([str(empty), "--out", str(tmp_path / "p")], "no committed checkpoint under"),
        ([roots["q"], "--out", str(tmp_path / "p"), "--storage-option", "novalue"], "expects KEY=VALUE"),
    ]
    for argv, message in cases:
        code, out, err = _report(capsys, *argv)
        assert code == 2, (argv, code, err)
        assert message in err and "Traceback" not in err, (argv, err)
        assert len(err.strip().splitlines()) == 1, (argv, err)
    assert not (tmp_path / "p").exists()
    code, _, err = _report(capsys, str(bad_json))  # argparse: usage + error
    assert code == 2 and "--out" in err


@pytest.mark.timeout(60)
def test_compact_and_export_refuse_a_corrupt_chain(roots, tmp_path, capsys):
    root = _copy(roots["q"], tmp_path)
    _flip(os.path.join(root, "ckpt-00000001", "rank-00000.bin"), 50)
    for argv in (["compact", root], ["export", root, "--out", str(tmp_path / "e.pt")]):
        code, _, err = _run(capsys, *argv)
        assert code == 1 and "ckpt-00000001/rank-00000.bin" in err and "Traceback" not in err, err
    assert sorted(os.listdir(root)) == ["ckpt-00000000", "ckpt-00000001", "ckpt-00000002", "ckpt-00000003",
                                        "index.json"]
    assert not (tmp_path / "e.pt").exists()


def test_cnr_alone_prints_the_commands(capsys):
    code, out, err = _run(capsys)
    assert code == 0 and err == ""
    assert out.startswith("usage: cnr")
    for command in ("inspect", "verify", "compact", "export", "import-dcp"):
        assert f"    {command}" in out, out


@pytest.mark.timeout(60)
def test_debug_puts_the_traceback_before_the_one_line_error(tmp_path, capsys):
    missing = str(tmp_path / "missing")
    code, _, plain = _run(capsys, "inspect", missing)
    assert code == 2 and "Traceback" not in plain and len(plain.strip().splitlines()) == 1
    for argv in (["--debug", "inspect", missing], ["inspect", missing, "--debug"]):
        code, _, err = _run(capsys, *argv)
        lines = err.strip().splitlines()
        assert code == 2 and lines[0].startswith("Traceback") and "cnr_torchrec" in err, err
        assert lines[-1] == plain.strip()


@pytest.mark.timeout(120)
def test_installed_entry_point_help():
    exe = os.path.join(os.path.dirname(sys.executable), "cnr")
    result = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr
    for command in ("inspect", "verify", "compact", "export"):
        assert command in result.stdout


def test_report_is_the_jobs_command_not_the_librarys(capsys):
    """The plots moved out of the library with the training job: ``cnr report`` is gone, ``python -m
    cnr_dlrm.report`` runs from the repository root."""
    code, _, err = _run(capsys, "report", "x.json", "--out", "p")
    assert code == 2 and "invalid choice: 'report'" in err
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-m", "cnr_dlrm.report", "--help"], cwd=root, capture_output=True,
                            text=True, timeout=110)
    assert result.returncode == 0, result.stderr
    assert "usage: python -m cnr_dlrm.report" in result.stdout and "--storage-option" in result.stdout


def test_inspect_of_a_thousand_checkpoints_stays_short():
    from cnr_torchrec.cli_text import inspect_text as _inspect_text

    def row(i, base, depth):
        return {"id": i, "step": 10 * i, "kind": "delta" if depth else "baseline", "policy": "consecutive",
                "base": base, "depth": depth, "method": "adaptive", "bits": 4, "nbytes": 1000, "rows_written": 5,
                "total_rows": 100, "dirty_fraction": 0.05, "stall_ms": 1.0, "write_ms": 2.0, "compacted_from": None,
                "broken_member": None}

    # 1,000 checkpoints: a compaction every 17, each baseline with 16 deltas on it.
    rows = [row(i, i - i % 17, i % 17) for i in range(1000)]
    summary = {"root": "/r", "world_size": 2, "checkpoints": rows, "full_snapshot_nbytes": 10**6,
               "full_snapshot_table_nbytes": 10**6, "total_nbytes": 10**6, "corrupt": [], "uncommitted": []}
    text = _inspect_text(summary, last=40)
    lines = text.splitlines()
    assert len(lines) < 40 + 1000 // 17 + 12 and max(map(len, lines)) < 200
    assert "960 older ones not shown" in text
    assert "baseline 986 (step 9860): 13 delta(s) 987..999, the newest 999 (step 9990) restores 14" in text
    assert len(_inspect_text(summary, last=None).splitlines()) > 1000
