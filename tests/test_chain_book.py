"""The chain the next save extends (save/chain_book.py), through the events every rank sees alike."""

from __future__ import annotations

from cnr_torchrec.ckpt.save.chain_book import ChainBook
from cnr_torchrec.ckpt.save.planner import decide


def _decide(book, step):
    return decide(policy="consecutive", state=book.state, step=step, dirty_since_previous={"t": 3},
                  dirty_since_baseline={"t": 3}, held_rows={"t": 10}, full_shard_fraction=0.5,
                  force_baseline=book.force_baseline)


def test_a_committed_save_extends_the_chain_and_a_failed_one_forces_a_baseline_once():
    book = ChainBook(next_id=0)
    base = _decide(book, 1)
    assert base.kind == "baseline"
    book.decided(base)
    book.settle(base, 100)
    delta = _decide(book, 2)
    assert (delta.kind, delta.chain) == ("delta", (0, 1))
    book.decided(delta)
    book.settle(delta, None)  # failed
    book.settle(delta, 7)  # a second settle of the same save changes nothing
    assert book.state.chain == () and book.state.next_id == 2
    assert book.force_baseline == "previous save 1 failed"
    again = _decide(book, 3)
    assert (again.kind, again.ckpt_id) == ("baseline", 2)
    book.decided(again)
    assert book.force_baseline == ""


def test_a_restore_goes_on_from_a_consecutive_chain_and_rebases_the_others():
    book = ChainBook(next_id=0)
    book.after_restore([(4, 100), (5, 10), (6, 12)], 9, goes_on=True)
    assert (book.state.next_id, book.state.chain, book.state.baseline_bytes, book.state.delta_bytes) == (
        9, (4, 5, 6), 100, (10, 12))
    assert book.force_baseline == ""
    book.after_restore([(4, 100)], 9, goes_on=False)
    assert book.state.chain == () and book.force_baseline == "after restore"
