"""What a new user meets first: the log lines a restore prints, the warnings a start prints, and a torchrun
launch whose restarts would hang (issue 46, item 5).

- With no logging configured, a restore says so once on stderr, with the rank; with logging configured
  by the application (before the Checkpointer, or after it), the application's handler prints it once
  and the library adds nothing; ``CNR_TORCHREC_LOG=off`` keeps it quiet. Each case runs in a fresh
  process, since logging's configuration is global.
- A 2-rank start, save and restore emits no FutureWarning or DeprecationWarning caused by a call that
  cnr_torchrec makes (torch 2.13 deprecates ``all_gather_into_tensor``).
- ``CheckNRunDMP`` refuses a gloo group whose keys sit in torchrun's shared rendezvous store when
  restarts are allowed (pytorch/pytorch#135712), and accepts the launches that restart cleanly.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- the log line of a restore ---------------------------------------------------------------------

# One rank (a file rendezvous: no torchrun), a save, then a restore; only logging's set-up differs by case.
_RESTORE_SCRIPT = textwrap.dedent("""
    import logging, os, sys, tempfile
    case = sys.argv[1]
    if case == "configured_before_import":
        logging.basicConfig(level=logging.INFO, format="APP %(levelname)s %(message)s")
    import torch.distributed as dist
    sys.path[:0] = [{repo!r}, os.path.join({repo!r}, "tests")]
    from _toy import build_dmp
    from cnr_torchrec import Checkpointer, load_config
    from examples.toy import TableSpec

    tmp = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "rdzv"), rank=0, world_size=1)
    dmp, opt = build_dmp([TableSpec("t0", 40, 4, "table_wise", "ebc")])
    config = load_config("consecutive", root=os.path.join(tmp, "root"))
    with Checkpointer(dmp, config, dense_optimizer=opt) as ck:
        ck.save(2).wait()
    if case == "configured_after_checkpointer":
        logging.basicConfig(level=logging.INFO, format="APP %(levelname)s %(message)s", force=True)
    with Checkpointer(dmp, config, dense_optimizer=opt) as ck:
        step = ck.restore()
    print("handlers", len(logging.getLogger("cnr_torchrec").handlers), "step", step, flush=True)
    dist.destroy_process_group()
""").format(repo=REPO)


def _restore_in_a_fresh_process(case: str, tmp_path, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "restore.py"
    script.write_text(_RESTORE_SCRIPT)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("CNR_TORCHREC_LOG", "TORCHELASTIC_"))}
    run = subprocess.run([sys.executable, str(script), case], env=environ | {"OMP_NUM_THREADS": "1", **env},
                         cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "step 2" in run.stdout
    return run


def _restore_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "restored checkpoint" in line]


@pytest.mark.timeout(300)
def test_a_restore_is_printed_once_with_the_rank_when_logging_is_not_configured(tmp_path):
    run = _restore_in_a_fresh_process("plain", tmp_path)
    lines = _restore_lines(run.stderr)
    assert len(lines) == 1, run.stderr[-3000:]  # once: not again through the root handler fbgemm's import left
    assert re.fullmatch(r"\[cnr rank 0\] restored checkpoint \d+ \(step 2, chain \[[\d, ]+\]\)", lines[0]), lines
    assert "handlers 1" in run.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["configured_before_import", "configured_after_checkpointer"])
def test_logging_the_application_configured_prints_the_restore_once_and_alone(case, tmp_path):
    """basicConfig before the imports: the library adds no handler. basicConfig after a Checkpointer added
    its handler: that handler goes quiet, and the application's prints the line instead, once."""
    run = _restore_in_a_fresh_process(case, tmp_path)
    lines = _restore_lines(run.stderr)
    assert len(lines) == 1 and lines[0].startswith("APP INFO restored checkpoint"), run.stderr[-3000:]
    if case == "configured_before_import":
        assert "[cnr" not in run.stderr and "handlers 0" in run.stdout
    else:  # the library's handler printed the first Checkpointer's lines, and none after basicConfig
        assert "[cnr rank 0] save" in run.stderr
        assert "[cnr" not in run.stderr.split("APP INFO", 1)[1]


@pytest.mark.timeout(300)
def test_the_log_lines_can_be_turned_off(tmp_path):
    run = _restore_in_a_fresh_process("plain", tmp_path, CNR_TORCHREC_LOG="off")
    assert _restore_lines(run.stderr) == [] and "[cnr" not in run.stderr
    assert "handlers 0" in run.stdout


def test_a_bad_log_setting_is_named(monkeypatch):
    from cnr_torchrec._logging import install_default_handler
    from cnr_torchrec.errors import ConfigError

    monkeypatch.setenv("CNR_TORCHREC_LOG", "loud")
    with pytest.raises(ConfigError, match=r"CNR_TORCHREC_LOG='loud'.*off.*'info'"):
        install_default_handler()


# ---- no deprecation warnings of our making ---------------------------------------------------------

_MACHINERY = (os.sep + "warnings.py", os.sep + "typing_extensions.py", "<frozen importlib")


def _package(filename: str) -> str:
    """The top-level package a frame's file belongs to (``cnr_torchrec``, ``torch``, ...)."""
    path = os.path.abspath(filename)
    if "site-packages" + os.sep in path:
        return path.split("site-packages" + os.sep, 1)[1].split(os.sep)[0].removesuffix(".py")
    if path.startswith(REPO + os.sep):
        return os.path.relpath(path, REPO).split(os.sep)[0]
    return "<stdlib or elsewhere>"


def _cause(stack) -> tuple[str, str]:
    """Who made the call that warned: the first frame, going outwards from the warning, outside the package
    that issued it (a deprecated torch function called by cnr_torchrec: cnr_torchrec). A warning issued by
    cnr_torchrec itself is cnr_torchrec's."""
    frames = [f for f in reversed(stack) if not any(m in f.filename for m in _MACHINERY)]
    issuer = _package(frames[0].filename)
    if issuer == "cnr_torchrec":
        return issuer, f"{frames[0].filename}:{frames[0].lineno}"
    for f in frames[1:]:
        if _package(f.filename) != issuer:
            return _package(f.filename), f"{f.filename}:{f.lineno}"
    return issuer, ""


def _start_save_restore_recording_warnings(rank, world_size, root):
    import traceback
    import warnings

    ours = []

    def record(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, (DeprecationWarning, FutureWarning)):
            who, where = _cause(traceback.extract_stack()[:-1])
            if who == "cnr_torchrec":
                ours.append(f"{category.__name__} at {where}: {str(message).strip()[:160]}")

    warnings.simplefilter("always")  # every call warns, not only the first per place
    warnings.showwarning = record
    from _toy import build_dmp, train

    import torch

    from cnr_torchrec import Checkpointer, load_config
    from examples.toy import TableSpec

    specs = [TableSpec("t0", 64, 8, "row_wise"), TableSpec("t1", 64, 8, "table_wise")]
    dmp, opt = build_dmp(specs)
    gen = torch.Generator().manual_seed(rank)
    with Checkpointer(dmp, load_config("consecutive", root=root), dense_optimizer=opt) as ck:
        train(dmp, specs, opt, 2, gen)
        ck.save(2).wait()
        train(dmp, specs, opt, 2, gen)
        ck.save(4).wait()
    with Checkpointer(dmp, load_config("consecutive", root=root), dense_optimizer=opt) as ck:
        assert ck.restore() == 4
    assert not ours, "deprecated calls made by cnr_torchrec:\n" + "\n".join(ours)


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_a_start_save_and_restore_cause_no_deprecation_warning(tmp_path):
    from _dist import run_ranks

    run_ranks(_start_save_restore_recording_warnings, world_size=2, args=(str(tmp_path / "root"),))


def test_the_cause_of_a_warning_is_the_caller_outside_the_issuing_package():
    """The attribution the test above relies on, on stacks shaped like those it sees."""
    from traceback import FrameSummary

    site = os.path.join(os.sep, "venv", "lib", "python3.11", "site-packages")

    def frame(path: str) -> FrameSummary:
        return FrameSummary(path, 1, "f")

    ours = frame(os.path.join(REPO, "cnr_torchrec", "ckpt", "_collective.py"))
    torch_wrapper = frame(os.path.join(site, "torch", "distributed", "c10d_logger.py"))
    deprecated = frame(os.path.join(site, "typing_extensions.py"))
    warn = frame(os.path.join(os.sep, "usr", "lib", "python3.11", "warnings.py"))
    assert _cause([frame(os.path.join(REPO, "tests", "t.py")), ours, torch_wrapper, deprecated, warn])[0] == \
        "cnr_torchrec"
    torchrec = frame(os.path.join(site, "torchrec", "distributed", "model_parallel.py"))
    ddp = frame(os.path.join(site, "torch", "nn", "parallel", "distributed.py"))
    assert _cause([ours, torchrec, ddp, warn])[0] == "torchrec"  # DMP's own DDP call: not ours


# ---- a torchrun launch whose restarts would hang ------------------------------------------------------


@pytest.fixture
def env_group(monkeypatch):
    """A one-rank gloo group that init_process_group rendezvoused itself (``env://``), as under torchrun."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    for key in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_MAX_RESTARTS", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        monkeypatch.delenv(key, raising=False)
    dist.init_process_group("gloo")
    yield
    dist.destroy_process_group()


def _build():
    from _toy import build_dmp

    from examples.toy import TableSpec

    return build_dmp([TableSpec("t0", 40, 4, "table_wise", "ebc")])


def _torchrun(monkeypatch, agent_store: str, max_restarts: str, disable_share: str | None) -> None:
    """What torchrun's agent puts in a worker's environment."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", agent_store)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", max_restarts)
    if disable_share is not None:
        monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", disable_share)


@pytest.mark.parametrize("disable_share,fix", [
    (None, "launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"),  # --standalone / c10d: the variable is the fix
    ("1", "launch with --rdzv-backend c10d"),  # set, yet the store is shared: the static rendezvous ignores it
])
def test_a_gloo_group_in_torchruns_shared_store_with_restarts_is_refused(env_group, monkeypatch, disable_share,
                                                                         fix):
    from cnr_torchrec.errors import ConfigError

    _torchrun(monkeypatch, "True", "1", disable_share)
    with pytest.raises(ConfigError) as e:
        _build()
    msg = str(e.value)
    assert fix in msg and "pytorch/pytorch#135712" in msg and "connectFullMesh" in msg
    assert "TORCHELASTIC_MAX_RESTARTS=1" in msg and "--max-restarts 0" in msg and "PrefixStore" in msg


@pytest.mark.parametrize("agent_store,max_restarts,disable_share", [
    ("True", "0", None),  # no restarts: nothing would hang
    ("False", "3", "1"),  # --standalone with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a new store each restart
])
def test_launches_that_restart_cleanly_are_accepted(env_group, monkeypatch, agent_store, max_restarts,
                                                    disable_share):
    _torchrun(monkeypatch, agent_store, max_restarts, disable_share)
    dmp, _ = _build()
    assert dmp.dirty_tracker.tables() == ["t0"]


def test_a_group_on_a_store_the_application_built_is_accepted(tmp_path, monkeypatch):
    """cnr_dlrm's launch passes init_process_group a store prefixed with the round: the library cannot see the
    prefix, and leaves such a group alone."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    _torchrun(monkeypatch, "True", "1", None)
    store = dist.PrefixStore("cnr/round-1", dist.FileStore(str(tmp_path / "store"), 1))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        dmp, _ = _build()
        assert dmp.dirty_tracker.tables() == ["t0"]
    finally:
        dist.destroy_process_group()
