"""``cnr export --out``: anything already at the path is refused, before the chain is read.

"Anything" is what ``os.path.lexists`` sees, not only a regular file: a directory (``--format
torch`` would otherwise decode the whole chain and fail only when it moves the file into place)
and a symlink whose target is missing (which a write would replace, or write through). Each is
refused with exit status 2 and one line, and is left as it was. That nothing is read first is
shown on a chain whose newest manifest is damaged: reading anything of the chain exits 1 naming
that file, so an export that read before refusing would say that instead. (``--format dcp`` has a
second guard in ``export_dcp``, but it comes after the chain's manifests are read.)
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from _toy import build_dmp, train


def _write_chain(root: str) -> None:
    """A baseline and one delta of the toy model, coded plainly (nothing here depends on the codec)."""
    from cnr_torchrec import Checkpointer, load_config
    from examples.toy import TableSpec

    specs = [TableSpec("t0", 32, 8, "row_wise"), TableSpec("t1", 16, 4, "table_wise")]
    dmp, opt = build_dmp(specs)
    gen = torch.Generator().manual_seed(0)
    with Checkpointer(dmp, load_config({"root": root, "quantization": {"residual": False}}),
                      dense_optimizer=opt) as ck:
        for step in (1, 2):
            train(dmp, specs, opt, 2, gen)
            ck.save(step).wait()


@pytest.fixture(scope="module")
def chains(group, tmp_path_factory):
    """A sound root, and a copy whose newest manifest has a byte flipped (any read of its chain exits 1)."""
    base = tmp_path_factory.mktemp("export_out")
    sound, damaged = str(base / "sound"), str(base / "damaged")
    _write_chain(sound)
    shutil.copytree(sound, damaged)
    path = os.path.join(damaged, "ckpt-00000001", "manifest.json")
    with open(path, "r+b") as f:
        at = os.path.getsize(path) // 2
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))
    return {"sound": sound, "damaged": damaged, "damaged_file": "ckpt-00000001/manifest.json"}


def _export(capsys, root: str, out: str, fmt: str) -> tuple[int, str, str]:
    from cnr_torchrec.cli import main

    code = main(["export", root, "--out", out, "--format", fmt])
    printed, err = capsys.readouterr()
    return code, printed, err


def _take(tmp_path, kind: str) -> str:
    """Beside an existing directory holding a file and a symlink to a path that does not exist, the one named
    by ``kind``."""
    directory = tmp_path / "taken_dir"
    directory.mkdir()
    (directory / "keep.txt").write_text("keep me")
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "missing_target", dangling)
    return str(directory if kind == "directory" else dangling)


def _assert_untouched(tmp_path) -> None:
    assert os.listdir(tmp_path / "taken_dir") == ["keep.txt"]
    assert (tmp_path / "taken_dir" / "keep.txt").read_text() == "keep me"
    assert os.path.islink(tmp_path / "dangling")
    assert os.readlink(tmp_path / "dangling") == str(tmp_path / "missing_target")
    assert not os.path.lexists(tmp_path / "missing_target")
    assert sorted(os.listdir(tmp_path)) == ["dangling", "taken_dir"]  # no temporary file left beside them


_CASES = pytest.mark.parametrize("fmt, kind", [(f, k) for f in ("torch", "dcp") for k in ("directory", "dangling")])


@pytest.mark.timeout(120)
@_CASES
def test_export_refuses_a_directory_or_a_dangling_symlink_at_out(chains, tmp_path, capsys, fmt, kind):
    out = _take(tmp_path, kind)
    code, printed, err = _export(capsys, chains["sound"], out, fmt)
    assert (code, printed) == (2, ""), (code, printed, err)
    what = "directory" if fmt == "dcp" else "file"
    assert err == f"cnr export: ConfigError: {out} exists; give --out a new {what} (an export never overwrites)\n"
    _assert_untouched(tmp_path)


@pytest.mark.timeout(120)
@_CASES
def test_export_refuses_out_before_reading_the_chain(chains, tmp_path, capsys, fmt, kind):
    out = _take(tmp_path, kind)
    code, printed, err = _export(capsys, chains["damaged"], out, fmt)
    assert (code, printed) == (2, ""), (code, err)
    assert err.startswith(f"cnr export: ConfigError: {out} exists; give --out a new ") and err.count("\n") == 1, err
    _assert_untouched(tmp_path)
    # With --out free, the same export reads the chain and stops at the damaged manifest.
    code, _, err = _export(capsys, chains["damaged"], str(tmp_path / "free"), fmt)
    assert code == 1 and chains["damaged_file"] in err, (code, err)
    assert not os.path.lexists(tmp_path / "free")
