"""A follower through background compaction and retention: with a lease, it applies every delta it has not
read and adopts the compacted baseline, reloading nothing; without one, the chain it served is collected
and it reloads, saying why.

One rank trains the publishing tests' model (``_publish_job``) with residual deltas, a compaction every 2
deltas and retention of the newest checkpoint only. The served tables are compared with what
``Checkpointer.restore()`` of the newest checkpoint gives a sharded model.
"""

from __future__ import annotations

import os

import pytest
import torch

from _publish_job import assert_serves, serving_model, specs
from _toy import build_dmp, train


def _config(root, followers, residual=False):
    """Plain 4-bit deltas (merged losslessly by a compaction) or residual ones (folded at 8 bits)."""
    from cnr_torchrec import load_config

    return load_config({"root": root, "policy": "consecutive", "memory_tier": "off",
                        "quantization": {"residual": residual}, "compaction": {"max_chain": 2},
                        "keep": {"checkpoints": 1, "followers": followers}})


def _save(ck, dmp, opt, gen, step):
    train(dmp, specs(), opt, 2, gen)
    kind = ck.save(step).wait().kind
    ck.wait(compaction=True)  # a compaction started by this save has committed
    return kind


@pytest.mark.parametrize("followers,residual", [(["serving"], False), ([], False), (["serving"], True)])
def test_a_leased_follower_adopts_a_merge_and_reloads_after_a_fold_or_without_a_lease(group, tmp_path, followers,
                                                                                       residual):
    from cnr_torchrec import Checkpointer
    from cnr_torchrec.publish import Follower

    root = str(tmp_path / "root")
    dmp, opt = build_dmp(specs(), seed=0)
    gen = torch.Generator().manual_seed(0)
    model = serving_model()
    with Checkpointer(dmp, _config(root, followers, residual), dense_optimizer=opt) as ck:
        _save(ck, dmp, opt, gen, 0)
        with Follower(root, model, lease="serving") as follower:
            assert [u.how for u in follower.poll()] == ["reload"]
            # Deltas 1 and 2; then 0..2 folded into baseline 3 while delta 4 went on from 2; then delta 5 on 3.
            for step in (2, 4, 6, 8):
                _save(ck, dmp, opt, gen, step)
            updates = follower.poll()
            assert_serves(model, root)
            if followers and not residual:
                assert [(u.ckpt, u.how) for u in updates] == [(1, "delta"), (2, "delta"), (3, "adopt"), (5, "delta")]
                assert "equal to checkpoint 2, served" in updates[2].why and updates[2].rows == 0
            else:
                (update,) = updates
                assert update.how == "reload" and "a compaction of checkpoints 0..2" in update.why
                assert ("folded from" if residual else "compacted from") in update.why
            _save(ck, dmp, opt, gen, 10)  # the lease has moved on: retention collects the old chain now
            assert not os.path.exists(os.path.join(root, "ckpt-00000000"))
            assert [(u.ckpt, u.how) for u in follower.poll()] == [(6, "delta")]
            assert_serves(model, root)


def test_a_follower_on_a_delta_written_beside_a_compaction_reloads_and_says_why(group, tmp_path):
    from cnr_torchrec import Checkpointer
    from cnr_torchrec.publish import Follower

    root = str(tmp_path / "root")
    dmp, opt = build_dmp(specs(), seed=0)
    gen = torch.Generator().manual_seed(0)
    model = serving_model()
    with Checkpointer(dmp, _config(root, ["serving"]), dense_optimizer=opt) as ck:
        for step in (0, 2, 4, 6):
            _save(ck, dmp, opt, gen, step)
        with Follower(root, model, lease="serving") as follower:
            assert [u.ckpt for u in follower.poll()] == [4]  # delta 4, on 2, beside the compaction into 3
            _save(ck, dmp, opt, gen, 8)
            (update,) = follower.poll()
    assert update.how == "reload" and "went on beside the compaction of checkpoints 0..2 into 3" in update.why
    assert_serves(model, root)


def test_a_lease_older_than_its_max_age_keeps_nothing(group, tmp_path, caplog):
    from cnr_torchrec import Checkpointer, load_config
    from cnr_torchrec.ckpt.format.bytes.storage import Storage
    from cnr_torchrec.ckpt.format.leases import write_lease

    root = str(tmp_path / "root")
    dmp, opt = build_dmp(specs(), seed=0)
    gen = torch.Generator().manual_seed(0)
    config = load_config({"root": root, "policy": "full", "memory_tier": "off",
                          "keep": {"checkpoints": 1, "followers": ["gone"], "follower_max_age_s": 0.001}})
    with Checkpointer(dmp, config, dense_optimizer=opt) as ck:
        _save(ck, dmp, opt, gen, 0)
        storage = Storage(root)
        write_lease(storage, "gone", 0)
        storage.close()
        with caplog.at_level("WARNING", logger="cnr_torchrec.ckpt.format.leases"):
            _save(ck, dmp, opt, gen, 2)
    assert "follower gone last renewed its lease" in caplog.text
    assert not os.path.exists(os.path.join(root, "ckpt-00000000"))


def test_a_follower_name_that_cannot_name_a_file_is_refused(group, tmp_path):
    from cnr_torchrec import load_config
    from cnr_torchrec.errors import ConfigError

    with pytest.raises(ConfigError, match=r"keep.followers: '../x' cannot name a follower"):
        load_config({"root": str(tmp_path), "keep": {"checkpoints": 1, "followers": ["../x"]}})
    with pytest.raises(ConfigError, match=r"keep: followers: expected a list"):
        load_config({"root": str(tmp_path), "keep": {"checkpoints": 1, "followers": "serving"}})


def test_a_keyed_root_is_followed_with_its_key_and_an_unkeyed_checkpoint_in_it_is_never_served(group, tmp_path):
    """A follower given the root's key serves its checkpoints; without the key, or with another, it refuses the
    root by name; a checkpoint written into the keyed root without the key is refused and never served."""
    from cnr_torchrec import Checkpointer, load_config
    from cnr_torchrec.ckpt.format.bytes.integrity import load_key
    from cnr_torchrec.errors import UnauthenticatedCheckpointError
    from cnr_torchrec.publish import Follower

    key_file, other_file = str(tmp_path / "key"), str(tmp_path / "other")
    for path, secret in ((key_file, b"0123456789abcdef0123456789abcdef"), (other_file, b"f" * 32)):
        with open(path, "wb") as f:
            f.write(secret)
        os.chmod(path, 0o600)
    root = str(tmp_path / "root")
    dmp, opt = build_dmp(specs(), seed=0)
    gen = torch.Generator().manual_seed(0)
    keyed = load_config({"root": root, "policy": "consecutive", "memory_tier": "off",
                         "integrity": {"key_file": key_file}})
    with Checkpointer(dmp, keyed, dense_optimizer=opt) as ck:
        _save(ck, dmp, opt, gen, 0)
    model = serving_model()
    for key in (None, load_key(other_file, None)):
        with Follower(root, serving_model(), key=key) as stranger:
            with pytest.raises(UnauthenticatedCheckpointError):
                stranger.poll()
    with Follower(root, model, key=load_key(key_file, None)) as follower:
        assert [u.how for u in follower.poll()] == ["reload"]
        served = {k: v.clone() for k, v in model.state_dict().items()}
        unkeyed = load_config({"root": root, "policy": "consecutive", "memory_tier": "off"})
        with Checkpointer(dmp, unkeyed, dense_optimizer=opt) as ck:  # a job that lost its key
            _save(ck, dmp, opt, gen, 2)
        with pytest.raises(UnauthenticatedCheckpointError):
            follower.poll()
        assert follower.cursor.ckpt == 0 and all(torch.equal(v, served[k]) for k, v in model.state_dict().items())
