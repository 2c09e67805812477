"""The follower on TorchRec's own test models: TestSparseNN (tables shared by two and three features, weighted
id-score tables, mixed dims, every EBC sharding type) and TestMixedEmbeddingSparseArch (sequence tables beside a
pooled one), trained on 2 ranks from TorchRec's ModelInput batches with the default residual deltas.

After each commit, rank 0's follower serves an unsharded copy of the model; the reference is the trainer's
restore of the same checkpoint onto another plan (every table whole, by ``_torchrec_models.full_tables``), and
the served tables and dense layers must equal it, value for value.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks

SAVES = 4


def _served(model):
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    out = {}
    for m in model.modules():
        if isinstance(m, EmbeddingBagCollection):
            out |= {t: e.weight.detach() for t, e in m.embedding_bags.items()}
        elif isinstance(m, EmbeddingCollection):
            out |= {t: e.weight.detach() for t, e in m.embeddings.items()}
    return out


def _worker(rank, world_size, model, root, out):
    import _torchrec_models as M

    from cnr_torchrec import Checkpointer, load_config
    from cnr_torchrec.publish import Follower

    dmp, opt = M.build_dmp(model, "A", seed=0)
    ref, _ = M.build_dmp(model, "B", seed=1)
    config = load_config({"root": root, "policy": "consecutive", "memory_tier": "off", "keep_last": 100})
    serving, follower, seen, wrong = None, None, [], []
    with Checkpointer(dmp, config, dense_optimizer=opt) as ck, Checkpointer(ref, config) as restorer:
        for i in range(SAVES):
            for s in range(2):
                M.train_step(dmp, opt, M.make_batch(model, seed=1000 * i + 10 * s + rank))
            ck.save(i + 1).wait()
            dist.barrier()
            if rank == 0:
                if follower is None:
                    torch.manual_seed(7)
                    serving = M.make_model(model, sparse_device="cpu")
                    follower = Follower(root, serving)
                seen += [(u.ckpt, u.how) for u in follower.poll()]
            restorer.restore()
            want = M.full_tables(ref, model)  # every rank takes part
            dense = {k: v.detach().clone() for k, v in ref.state_dict().items() if not k.endswith(".weight")
                     or not any(f".{t}." in k for t in want)}
            if rank == 0:
                got = _served(serving)
                wrong += [(i, t) for t, (w, _, _) in want.items() if not torch.equal(got[t].double(), w)]
                mine = serving.state_dict()
                wrong += [(i, k) for k, v in dense.items() if k in mine and not torch.equal(mine[k], v)]
                assert any(k in mine for k in dense), sorted(dense)[:5]
    if rank == 0:
        follower.close()
        torch.save({"seen": seen, "wrong": wrong}, out)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["sparse_nn", "mixed"])
def test_a_follower_serves_torchrecs_models_as_the_trainers_restore_gives_them(tmp_path, model):
    out = str(tmp_path / "out.pt")
    run_ranks(_worker, 2, args=(model, str(tmp_path / "root"), out), timeout=240)
    result = torch.load(out)
    assert result["seen"] == [(0, "reload")] + [(i, "delta") for i in range(1, SAVES)]
    assert result["wrong"] == []
