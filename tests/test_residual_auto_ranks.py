"""``quantization.residual: auto`` on 2 ranks where only one rank holds a table with per-column optimizer state.

The EBC's tables train with EXACT_ADAGRAD (a sum of squares per weight) and the EC's with
EXACT_ROWWISE_ADAGRAD (one value per row); the EBC's only table is table_wise on rank 0, so rank 1
holds no per-column state of its own. Every rank must still take the same decision, plain coding,
name the same table, and go on to save together: a rank that decided alone would wait in a
collective its peer never enters, which the spawn's timeout turns into a failure.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from _dist import run_ranks

pytestmark = pytest.mark.multirank


def _specs():
    from examples.toy import TableSpec

    return [TableSpec("bag", 32, 8, "table_wise", "ebc"), TableSpec("seq", 48, 8, "row_wise", "ec")]


def _build():
    """The toy model in a CheckNRunDMP whose EBC uses EXACT_ADAGRAD and whose EC uses EXACT_ROWWISE_ADAGRAD."""
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingEnv

    from cnr_torchrec import CheckNRunDMP
    from examples.toy import ToyModel, build_plan

    torch.manual_seed(0)
    model = ToyModel(_specs())
    sharders = [EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD,
                                                            "learning_rate": 0.05}),
                EmbeddingCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                         "learning_rate": 0.05})]
    dmp = CheckNRunDMP(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                       plan=build_plan(model, sharders, dist.get_world_size()), sharders=sharders)
    dense = [p for n, p in dmp.named_parameters() if n.startswith("dense")]
    return dmp, torch.optim.Adam(dense, lr=0.01)


class _Lines(logging.Handler):
    """The messages of the records it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _worker(rank, world_size, root):
    import torch.distributed as dist
    from _toy import train

    from cnr_torchrec import Checkpointer, load_config
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.residual_choice import per_column_state_tables
    from cnr_torchrec.ckpt.tools.summary import summarize
    from cnr_torchrec.errors import ConfigError

    dmp, opt = _build()
    # The set-up this test is about: the per-column table lives on rank 0 only.
    assert per_column_state_tables(dmp.dirty_tracker) == (["bag"] if rank == 0 else []), rank
    assert "seq" in dmp.dirty_tracker.tables()

    # residual: true is refused on every rank, naming the table that only rank 0 holds, before anything is opened.
    with pytest.raises(ConfigError, match=r"residual: true does not work here: table\(s\) bag keep optimizer state "
                                          r"per column"):
        Checkpointer(dmp, load_config({"root": f"{root}/refused", "quantization": {"residual": True}}),
                     dense_optimizer=opt)
    dist.barrier()
    assert not os.path.exists(os.path.join(root, "refused"))

    # auto: plain coding on both ranks, each saying why with the same table.
    handler = _Lines()
    chooser = logging.getLogger("cnr_torchrec.ckpt.residual_choice")
    chooser.addHandler(handler)
    try:
        ck = Checkpointer(dmp, load_config({"root": f"{root}/auto"}), dense_optimizer=opt)
    finally:
        chooser.removeHandler(handler)
    decisions = [None] * world_size
    dist.all_gather_object(decisions, ck.config.quantization.residual)
    assert decisions == [False, False], decisions
    assert any("residual: auto steps aside" in line and "table(s) bag keep optimizer state per column" in line
               for line in handler.lines), (rank, handler.lines)

    gen = torch.Generator().manual_seed(rank)
    with ck:
        for step in (1, 2):
            train(dmp, _specs(), opt, 2, gen)
            ck.save(step).wait()
    if rank == 0:
        storage = Storage(f"{root}/auto")
        try:
            assert [r["residual"] for r in summarize(storage)["checkpoints"]] == [False, False]
        finally:
            storage.close()


@pytest.mark.timeout(180)
def test_auto_decides_alike_on_every_rank_when_one_rank_holds_per_column_state(tmp_path):
    run_ranks(_worker, world_size=2, timeout=120, args=(str(tmp_path),))
