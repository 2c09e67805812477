"""A job on two torchrun agents (c10d rendezvous, 4 ranks) with its checkpoints on s3 (moto).

It runs the scenario of ``benchmarks/multinode.py`` at its smallest: one rank killed half
way through writing its file of a save, the restart under ``--max-restarts``, the end state
against a peer that was never killed, then the same root resumed on one node of 2 ranks and
back on 4, each against the model the other world size held. ``make reliability`` runs it
with more steps.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import multinode  # noqa: E402

pytest.importorskip("moto")


@pytest.mark.multirank
@pytest.mark.long
@pytest.mark.timeout(420)
def test_two_nodes_on_s3_survive_a_kill_mid_save_and_reshard_to_two_ranks_and_back(tmp_path):
    moto = multinode.Moto()
    try:
        figures = multinode.scenario(str(tmp_path), moto, steps=12, extra=4)
    finally:
        moto.close()
    # The kill hits a rank's second payload write: step 8's save, or step 12's if step 8's was skipped
    # while step 4's still wrote; the restore takes the newest committed checkpoint before it.
    assert figures["killed"]["restored_step"] in (4, 8)
    assert figures["objects"] > 0
