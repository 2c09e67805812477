"""The save planner's rules (save/planner.py): baseline or delta per policy, the encodings each table gets,
the intermittent rule against a hand-computed reference, and a failed save's baseline."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from cnr_torchrec.ckpt.save.planner import ChainState, Decision, decide, intermittent_wants_baseline

POLICIES = ("full", "one_shot", "consecutive", "intermittent")


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
