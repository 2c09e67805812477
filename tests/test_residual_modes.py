"""A residual chain restores every row within what coding that row whole gives (a mode per row).

TorchRec's TestSparseNN (table-wise, row-wise, column-wise, table-row-wise and data-parallel tables,
weighted features, shared tables) and an EBC + EC model train on a loss that shrinks the rows they
look up (the squared embeddings), so a row's change between saves outgrows the row. Each is saved
every two steps on 2 ranks under plan A, with residual coding, and restored onto the same plan and
onto plan B on 1 rank. Every restored row, per column piece the save stored, is compared with the
live row at the last save, against the error of coding that row whole with the codec's own
``encode``/``decode`` (what plain coding restores), by the measure the codec fits its grid to (the
largest absolute error for ``uniform_asym``, at 8 bits also against 1/255 of the row's range from the
codec's definition; the sum of squared errors for ``adaptive`` and ``kmeans``). With every row forced to a residual
(today's coding before the mode) the same check fails: the scenario bites.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from _dist import run_ranks

ARMS = {"uniform_asym": 8, "adaptive": 4, "kmeans": 2}
SAVES = 4


def _shrink_step(dmp, opt, batch) -> None:
    """One step of a loss that pulls the looked-up rows toward zero: the sum of the squared embeddings."""
    emb = dmp.module.sparse_forward(batch)
    values = emb if isinstance(emb, torch.Tensor) else emb.values()  # TestSparseNN: a KeyedTensor
    values.pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _config(root, method, bits):
    from cnr_torchrec import load_config

    return load_config({"root": root, "policy": "consecutive", "compaction": None,
                        "quantization": {"method": method, "bits": bits, "residual": True}})


@contextlib.contextmanager
def _every_row_residual(on: bool):
    """Codes every row of a residual delta as a residual (as before the mode), while in the block and ``on``."""
    import cnr_torchrec.ckpt.save.coding as coding

    def residual_only(codec, x, r, restored):
        encoded = codec.encode(x - r)
        torch.add(r, codec.decode(encoded), out=restored)
        return encoded, torch.zeros(x.shape[0], dtype=torch.bool)

    real = coding._closer
    coding._closer = residual_only if on else real
    try:
        yield
    finally:
        coding._closer = real


def _save_worker(rank, world_size, root, model, arms, live_path):
    """Each arm (``method/bits/modes``) trains the same model on the same batches and saves a residual chain;
    rank 0 keeps the live tables at the last save."""
    import _torchrec_models as M

    from cnr_torchrec import Checkpointer

    live = {}
    for arm in arms:
        method, bits, modes = arm.split("/")
        dmp, opt = M.build_dmp(model, "A")
        config = _config(f"{root}/{arm}", method, int(bits))
        with _every_row_residual(modes == "off"), Checkpointer(dmp, config, dense_optimizer=opt) as ck:
            for step in range(1, 2 * SAVES + 1):
                _shrink_step(dmp, opt, M.make_batch(model, seed=100 * step + rank))
                if step % 2 == 0:
                    ck.save(step).wait()
        live[arm] = {t: w.float() for t, (w, _, _) in M.full_tables(dmp, model).items()}
    if rank == 0:
        torch.save(live, live_path)


def _pieces(model):
    """Per table, the column ranges plan A cuts it into (None for a data-parallel table), from TorchRec's plan."""
    import _torchrec_models as M

    module = M.make_model(model)
    plan = M.build_plan(module, model, "A", 2)
    out = {}
    for module_plan in plan.plan.values():
        for table, sharding in module_plan.items():
            if sharding.sharding_spec is None:
                out[table] = None
                continue
            cols = {(s.shard_offsets[1], s.shard_offsets[1] + s.shard_sizes[1]) for s in sharding.sharding_spec.shards}
            out[table] = sorted(cols)
    return out


def _error(method, got, want):
    """Per row, the error by the measure ``method`` fits its grid to: the largest absolute error for uniform_asym's
    grid over [min, max], the sum of squared errors for adaptive's least-squares search and k-means."""
    diff = got - want
    return diff.abs().amax(1) if method == "uniform_asym" else diff.square().sum(1)


def _beyond(restored, live, pieces, method, bits):
    """Rows (per stored column piece) whose restored error exceeds what coding them whole gives, by the codec's
    measure. Returns (count, the worst error over that bound, and for uniform_asym the worst largest error /
    row range over the rows whose whole coding is within 1/(2**bits - 1) of their range: the codec's bound,
    which float16 scales miss for rows of a few 1e-6)."""
    from cnr_torchrec.quant import get_codec

    codec = get_codec(method, bits)
    count, worst, worst_span = 0, 0.0, None
    for table, cuts in pieces.items():
        if cuts is None:  # stored whole in float32
            torch.testing.assert_close(restored[table], live[table], rtol=0, atol=0)
            continue
        for c0, c1 in cuts:
            x, got = live[table][:, c0:c1].contiguous(), restored[table][:, c0:c1]
            err = _error(method, got, x)
            plain = _error(method, codec.decode(codec.encode(x)), x)
            ulps = 1e-6 * x.abs().amax(1) + 1e-9  # float32 sums in another order
            bound = plain + (ulps if method == "uniform_asym" else 2 * plain.sqrt() * ulps + ulps**2 * (c1 - c0))
            count += int((err > bound).sum())
            worst = max(worst, float((err / bound).max()))
            if method == "uniform_asym":
                span = x.amax(1) - x.amin(1)
                held = plain <= span / (2**bits - 1)
                worst_span = max(worst_span or 0.0, float((err[held] / span[held]).max()))
    return count, worst, worst_span


def _restore_worker(rank, world_size, root, model, arms, plan, live_path, out_path):
    import _torchrec_models as M

    from cnr_torchrec import Checkpointer

    live = torch.load(live_path, weights_only=True)
    pieces = _pieces(model)
    found = {}
    for arm in arms:
        method, bits, _ = arm.split("/")
        dmp, opt = M.build_dmp(model, plan, seed=9)
        with Checkpointer(dmp, _config(f"{root}/{arm}", method, int(bits)), dense_optimizer=opt) as ck:
            assert ck.restore() == 2 * SAVES
        restored = {t: w.float() for t, (w, _, _) in M.full_tables(dmp, model).items()}
        found[arm] = _beyond(restored, live[arm], pieces, method, int(bits))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(found, f)


@pytest.mark.multirank
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", ["sparse_nn", pytest.param("mixed", marks=pytest.mark.long)])
def test_every_restored_row_is_within_what_coding_it_whole_gives(tmp_path, model):
    root, live, out = str(tmp_path / "ck"), str(tmp_path / "live.pt"), str(tmp_path / "out.json")
    arms = [f"{m}/{b}/{modes}" for m, b in ARMS.items() for modes in ("on", "off")]
    run_ranks(_save_worker, world_size=2, timeout=300, args=(root, model, arms, live))
    results = {}
    for plan, ranks in (("A", 2), ("B", 1)):
        run_ranks(_restore_worker, world_size=ranks, timeout=200, args=(root, model, arms, plan, live, out))
        with open(out) as f:
            results[plan] = json.load(f)
    print(json.dumps(results))
    for plan, found in results.items():
        for arm, (count, worst, worst_span) in found.items():
            if arm.endswith("/on"):
                assert count == 0, (plan, arm, count, worst)
                assert worst_span is None or worst_span <= 1 / 255, (plan, arm, worst_span)
            else:  # every row a residual: some rows restore beyond what coding them whole gives
                assert count > 0, (plan, arm, worst)
