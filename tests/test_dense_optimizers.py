"""Every kind of dense optimizer a TorchRec user passes to the Checkpointer restores exactly.

torch.optim optimizers, TorchRec's KeyedOptimizerWrapper and CombinedOptimizer (built as TorchRec's
golden_training example builds its dense optimizer, over ``in_backward_optimizer_filter(named_parameters())``)
and a class of the user's own with nothing but ``state_dict``/``load_state_dict``: each is trained on a
CheckNRunDMP, saved, trained on, then restored into a freshly built model and optimizer. The reference
is the uninterrupted run: the restored optimizer's ``state_dict()`` and hyperparameters equal those at the
save, and one more step from there gives bit-identical weights and optimizer state. An optimizer the
Checkpointer cannot store is refused when it is built; a checkpoint restored into another optimizer class
names both classes; ``cnr inspect`` and ``cnr verify`` say which dense optimizer each checkpoint holds.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from _dist import run_ranks
from _toy import build_dmp, local_state

from cnr_torchrec.errors import ConfigError, IncompatibleCheckpointError

pytestmark = pytest.mark.timeout(120)

KEYED_WRAPPER = "torchrec.optim.keyed.KeyedOptimizerWrapper"


def _specs():
    from examples.toy import TableSpec

    # The data_parallel table's weight is a dense parameter: the dense optimizer updates it beside the tower.
    return [TableSpec("a", 32, 8, "table_wise"), TableSpec("b", 32, 8, "row_wise"),
            TableSpec("c", 24, 4, "data_parallel")]


class HeavyBall:
    """A hand-written heavy-ball SGD that is no torch.optim.Optimizer: it has step, zero_grad, state_dict and
    load_state_dict, and a state layout of its own."""

    def __init__(self, named: dict[str, torch.Tensor], lr: float) -> None:
        self.named, self.lr, self.steps = named, lr, 0
        self.velocity = {n: torch.zeros(p.shape, dtype=p.dtype) for n, p in named.items()}

    def step(self) -> None:
        with torch.no_grad():
            for n, p in self.named.items():
                if p.grad is not None:
                    self.velocity[n].mul_(0.9).add_(p.grad)
                    p.sub_(self.lr * self.velocity[n])
        self.steps += 1

    def zero_grad(self) -> None:
        for p in self.named.values():
            p.grad = None

    def state_dict(self) -> dict:
        return {"velocity": dict(self.velocity), "steps": self.steps, "lr": self.lr}

    def load_state_dict(self, state: dict) -> None:
        for n, v in state["velocity"].items():
            self.velocity[n].copy_(v)
        self.steps, self.lr = state["steps"], state["lr"]


def _keyed(named, factory):
    from torchrec.optim.keyed import KeyedOptimizerWrapper

    return KeyedOptimizerWrapper(named, factory)


def _combined(named):
    from torchrec.optim.keyed import CombinedOptimizer

    tower = {n: p for n, p in named.items() if n.startswith("dense")}
    tables = {n: p for n, p in named.items() if n not in tower}
    # Both create their state lazily, at the first step; the weight decay makes a step with zero gradients (how
    # KeyedOptimizer creates state to load into) move the weights.
    return CombinedOptimizer([
        ("tower", _keyed(tower, lambda ps: torch.optim.Adam(ps, lr=0.01))),
        ("tables", _keyed(tables, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01))),
    ])


OPTIMIZERS = {
    "adagrad": lambda named: torch.optim.Adagrad(list(named.values()), lr=0.05),
    "sgd_momentum": lambda named: torch.optim.SGD(list(named.values()), lr=0.05, momentum=0.9),
    "keyed_wrapper": lambda named: _keyed(named, lambda ps: torch.optim.Adagrad(ps, lr=0.05)),
    "combined": _combined,
    "custom": lambda named: HeavyBall(named, lr=0.05),
}


def _build(seed, make):
    """A CheckNRunDMP of :func:`_specs` and ``make`` applied to its dense parameters by name, filtered as
    TorchRec's golden_training example filters them."""
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dmp, _ = build_dmp(_specs(), seed=seed, dense_optimizer=lambda params, lr: None)
    return dmp, make(dict(in_backward_optimizer_filter(dmp.named_parameters())))


def _config(root):
    from cnr_torchrec import load_config

    return load_config({"root": str(root), "policy": "consecutive",
                        "quantization": {"method": "none", "bits": None, "residual": False}})


def _batches(seed, n):
    from examples.toy import zipf_batch

    gen = torch.Generator().manual_seed(seed)
    return [zipf_batch(_specs(), batch_size=8, pooling=3, generator=gen, alpha=1.05) for _ in range(n)]


def _step(dmp, opt, batch):
    dmp(batch).backward()
    opt.step()
    opt.zero_grad()


def _halve_lr(opt):
    """What a learning-rate schedule does between steps: the restore must bring the changed rate back."""
    if hasattr(opt, "param_groups"):
        for group in opt.param_groups:
            group["lr"] *= 0.5
    else:
        opt.lr *= 0.5


def _opt_state(opt):
    """A copy of the optimizer's own state_dict() and of each group's hyperparameters."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in getattr(opt, "param_groups", [])]
    return copy.deepcopy({"state_dict": opt.state_dict(), "groups": groups})


def _model_state(dmp):
    return local_state(dmp) | {n: p.detach().clone() for n, p in dmp.named_parameters()}


def _assert_same(got, want, path="state"):
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (path, sorted(got), sorted(want))
        for k in want:
            _assert_same(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{path}[{i}]")
    else:
        assert got == want, (path, got, want)


def _save_train_restore(root, make, batch_seed=3):
    """Trains 3 steps (halving the learning rate after the second), saves, steps on; restores into a model and
    optimizer built from another seed and steps once. Returns (what the restored run had, the reference)."""
    from cnr_torchrec import Checkpointer

    batches = _batches(batch_seed, 5)
    dmp, opt = _build(0, make)
    ckpt = Checkpointer(dmp, _config(root), dense_optimizer=opt)
    for i in range(3):
        _step(dmp, opt, batches[i])
        if i == 1:
            _halve_lr(opt)
    ckpt.save(3).wait()
    want = {"at_save": _opt_state(opt)}
    _step(dmp, opt, batches[3])
    want |= {"model": _model_state(dmp), "after_step": _opt_state(opt)}
    _step(dmp, opt, batches[4])  # training goes on past the checkpoint
    ckpt.close()

    dmp2, opt2 = _build(1, make)
    ckpt2 = Checkpointer(dmp2, _config(root), dense_optimizer=opt2)
    assert ckpt2.restore() == 3
    ckpt2.close()
    got = {"at_save": _opt_state(opt2)}
    _step(dmp2, opt2, batches[3])
    got |= {"model": _model_state(dmp2), "after_step": _opt_state(opt2)}
    return got, want


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_dense_optimizer_restores_bit_identically(group, tmp_path, name):
    got, want = _save_train_restore(tmp_path / "ck", OPTIMIZERS[name])
    _assert_same(got["at_save"], want["at_save"], "optimizer at the save")
    _assert_same(got["model"], want["model"], "weights one step after the save")
    _assert_same(got["after_step"], want["after_step"], "optimizer one step after the save")


def _two_rank_worker(rank, world_size, root):
    got, want = _save_train_restore(root, OPTIMIZERS["keyed_wrapper"], batch_seed=3 + rank)
    _assert_same(got, want, f"rank {rank}")


@pytest.mark.multirank
def test_keyed_optimizer_restores_on_two_ranks(tmp_path):
    run_ranks(_two_rank_worker, world_size=2, timeout=110, args=(str(tmp_path / "ck"),))


def test_a_keyed_checkpoint_written_before_the_kind_was_recorded_restores(group):
    """The failing case of the issue: a keyed optimizer's state as earlier versions stored it (its bare
    state_dict() plus param_names), which their restore refused as a crafted manifest."""
    from cnr_torchrec.ckpt.live.dense_optim import load_dense_state

    dmp, opt = _build(0, OPTIMIZERS["keyed_wrapper"])
    _step(dmp, opt, _batches(3, 1)[0])
    old = copy.deepcopy({**opt.state_dict(), "param_names": sorted(opt.params)})
    _, fresh = _build(1, OPTIMIZERS["keyed_wrapper"])
    load_dense_state(dmp, fresh, old, "checkpoint 0")
    _assert_same(copy.deepcopy(fresh.state_dict()), {"state": old["state"]})


def test_a_checkpoint_restores_only_into_the_optimizer_class_that_saved_it(group, tmp_path):
    from cnr_torchrec import Checkpointer
    from cnr_torchrec.errors import IncompatibleCheckpointError

    def save(root, make):
        dmp, opt = _build(0, make)
        ckpt = Checkpointer(dmp, _config(root), dense_optimizer=opt)
        _step(dmp, opt, _batches(3, 1)[0])
        ckpt.save(1).wait()
        ckpt.close()

    def restore(root, make):
        dmp, opt = _build(1, make)
        before = _opt_state(opt)
        ckpt = Checkpointer(dmp, _config(root), dense_optimizer=opt)
        try:
            with pytest.raises(IncompatibleCheckpointError) as err:
                ckpt.restore()
        finally:
            ckpt.close()
        _assert_same(_opt_state(opt), before, "the optimizer after a refused restore")
        return str(err.value)

    save(tmp_path / "torch", OPTIMIZERS["adagrad"])
    message = restore(tmp_path / "torch", OPTIMIZERS["keyed_wrapper"])
    assert "torch.optim.adagrad.Adagrad" in message and KEYED_WRAPPER in message, message
    assert "malformed" not in message and "crafted" not in message

    save(tmp_path / "keyed", OPTIMIZERS["keyed_wrapper"])  # same class, another optimizer inside it
    message = restore(tmp_path / "keyed",
                      lambda named: _keyed(named, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)))
    assert "momentum_buffer" in message and "sum" in message, message


class _SavesOnly:
    def state_dict(self):
        return {}


class _HoldsASet(HeavyBall):
    def state_dict(self):
        return {**super().state_dict(), "seen": {"a", "b"}}


def _dtensor_keyed(named):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Replicate()]))
    return _keyed({**named, "table": sharded}, lambda ps: torch.optim.SGD(ps, lr=0.1))


@pytest.mark.parametrize("make, says", [
    (lambda named: _SavesOnly(), r"has no state_dict\(\)/load_state_dict\(\)"),
    (lambda named: _HoldsASet(named, lr=0.1), r"holds a set, which cannot be stored"),
    (_dtensor_keyed, r"holds a DTensor at params\['table'\].*pass it only dense"),
    (lambda named: torch.optim.SGD([*named.values(), torch.nn.Parameter(torch.zeros(2))], lr=0.1),
     "not in the model"),
])
def test_an_optimizer_that_cannot_be_stored_is_refused_when_the_checkpointer_is_built(group, tmp_path, make, says):
    from cnr_torchrec import Checkpointer
    from cnr_torchrec.errors import ConfigError

    dmp, opt = _build(0, make)
    with pytest.raises(ConfigError, match=says):
        Checkpointer(dmp, _config(tmp_path / "ck"), dense_optimizer=opt)


def test_inspect_and_verify_show_each_checkpoints_dense_optimizer(group, tmp_path, capsys):
    from cnr_torchrec import Checkpointer
    from cnr_torchrec.cli import main

    root = tmp_path / "ck"
    dmp, opt = _build(0, OPTIMIZERS["keyed_wrapper"])
    batches = _batches(3, 2)
    with_opt = Checkpointer(dmp, _config(root), dense_optimizer=opt)
    for step in (1, 2):
        _step(dmp, opt, batches[step - 1])
        with_opt.save(step).wait()
    with_opt.close()
    without = Checkpointer(dmp, _config(root))  # the same job, resumed without its dense optimizer
    without.save(3).wait()
    without.close()

    assert main(["inspect", str(root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [r["dense_optimizer"] for r in rows] == [{"kind": "keyed", "class": KEYED_WRAPPER}] * 2 + [None]
    assert main(["inspect", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-1] == "optimizer"  # the table's last column
    assert [line.rstrip().split("  ")[-1] for line in lines[2:5]] == ["keyed (KeyedOptimizerWrapper)"] * 2 + ["none"]
    assert main(["verify", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1:] == [f"dense optimizer state keyed ({KEYED_WRAPPER}): checkpoint(s) 0-1",
                       "dense optimizer state none: checkpoint(s) 2"]


def test_dcp_export_carries_a_keyed_optimizer_by_name_and_leaves_an_opaque_one_out(group, tmp_path, caplog):
    """Export to DCP, import into a new root and restore: a keyed optimizer gets its state back (the import
    records no class, and its by-name form loads into a keyed optimizer), and so does ``load_dense_optimizer``
    straight from the export. An opaque optimizer's state has no names: the export leaves it out, logged."""
    import torch.distributed.checkpoint as dcp

    from cnr_torchrec import Checkpointer
    from cnr_torchrec.ckpt.tools.dcp import DENSE_OPTIM, load_dense_optimizer
    from cnr_torchrec.cli import main

    def save(root, make):
        dmp, opt = _build(0, make)
        ckpt = Checkpointer(dmp, _config(root), dense_optimizer=opt)
        for batch in _batches(3, 2):
            _step(dmp, opt, batch)
            _halve_lr(opt)
        ckpt.save(2).wait()
        ckpt.close()
        return _opt_state(opt)

    keyed = OPTIMIZERS["keyed_wrapper"]
    want = save(tmp_path / "keyed", keyed)
    assert main(["export", "--format", "dcp", str(tmp_path / "keyed"), "--out", str(tmp_path / "keyed.dcp")]) == 0
    assert main(["import-dcp", str(tmp_path / "keyed.dcp"), str(tmp_path / "imported")]) == 0
    dmp, opt = _build(1, keyed)
    with Checkpointer(dmp, _config(tmp_path / "imported"), dense_optimizer=opt) as ckpt:
        ckpt.restore()
    _assert_same(_opt_state(opt), want, "restored from the import")
    dmp, opt = _build(1, keyed)
    load_dense_optimizer(str(tmp_path / "keyed.dcp"), dmp, opt)
    _assert_same(_opt_state(opt), want, "loaded from the export")

    save(tmp_path / "opaque", OPTIMIZERS["custom"])
    assert main(["export", "--format", "dcp", str(tmp_path / "opaque"), "--out", str(tmp_path / "opaque.dcp")]) == 0
    keys = dcp.FileSystemReader(str(tmp_path / "opaque.dcp")).read_metadata().state_dict_metadata
    assert keys and not any(k.startswith(f"{DENSE_OPTIM}.") for k in keys)
    assert "opaque (test_dense_optimizers.HeavyBall)" in caplog.text and "leaves it out" in caplog.text


# ---- the dense optimizer's saved form, by parameter name (live/dense_optim.py)

def _adam_after_a_step(model):
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    return opt


def test_dense_optimizer_state_follows_parameter_names():
    from cnr_torchrec.ckpt.live.dense_optim_named import load_named_state, named_state

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
    from cnr_torchrec.ckpt.live.dense_optim_named import load_named_state, named_state, param_names

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


def _combined_reversed(named):
    """:func:`_combined`'s members, listed the other way round."""
    from torchrec.optim.keyed import CombinedOptimizer

    members = _combined(named).optimizers
    return CombinedOptimizer(list(reversed(members)))


def _hyper_by_params(opt):
    """Each group's hyperparameters, by the sorted keys of the parameters it holds."""
    key_of = {id(p): k for k, p in opt.params.items()}
    return {tuple(sorted(key_of[id(p)] for p in g["params"])): {k: v for k, v in g.items() if k != "params"}
            for g in opt.param_groups}


def test_a_combined_optimizer_whose_members_come_in_another_order_takes_each_groups_own_hyperparameters(
        group, tmp_path):
    """Hyperparameters follow the parameters they were saved for, never a group's position: with the members
    swapped, a group taken by position would resume with the other member's learning rate and weight decay."""
    from cnr_torchrec import Checkpointer

    batches = _batches(3, 4)
    dmp, opt = _build(0, _combined)
    with Checkpointer(dmp, _config(tmp_path / "ck"), dense_optimizer=opt) as ck:
        for i in range(3):
            _step(dmp, opt, batches[i])
            if i == 1:
                _halve_lr(opt)
        ck.save(3).wait()
    want_hyper = _hyper_by_params(opt)
    _step(dmp, opt, batches[3])
    want_model = _model_state(dmp)

    dmp2, opt2 = _build(1, _combined_reversed)
    with Checkpointer(dmp2, _config(tmp_path / "ck"), dense_optimizer=opt2) as ck:
        assert ck.restore() == 3
    got_hyper = _hyper_by_params(opt2)
    assert list(got_hyper) == list(want_hyper)[::-1]  # the groups come in the other order
    _assert_same(got_hyper, want_hyper, "hyperparameters by parameter")
    _step(dmp2, opt2, batches[3])
    _assert_same(_model_state(dmp2), want_model, "weights one step after the save")
