"""The README's commands, as a newcomer runs them: every ``cnr`` line of its shell blocks, against the root of the
demo job (``configs/demo.yaml``, shortened), with the README's placeholders (``ROOT``, ``D``, ``NEW_ROOT``) and its
demo path replaced by directories of this test; and every file or page it links to exists."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
DEMO_ROOT = "/tmp/cnr_demo/checkpoints"


def _shell_lines(text: str) -> list[str]:
    """The command lines of the README's ```bash blocks, comments dropped."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines += [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return [line for line in lines if line]


def _cnr_lines(text: str) -> list[str]:
    return [line for line in _shell_lines(text) if re.match(r"(\.venv/bin/)?cnr ", line)]


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory):
    """The demo job's checkpoints, from a short run of its own config under torchrun (2 gloo ranks)."""
    root = str(tmp_path_factory.mktemp("demo") / "checkpoints")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "cnr_dlrm.train", "--config", "configs/demo.yaml", "--set", f"checkpoint.root={root}",
           "--set", "train.steps=150"]
    run = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    return root


@pytest.mark.timeout(600)
def test_the_readmes_cnr_commands_run_against_the_demos_root(demo_root, tmp_path):
    lines = _cnr_lines(open(README).read())
    assert len(lines) >= 6, lines  # the demo's two, and the six of "The cnr command"
    names = {DEMO_ROOT: demo_root, "ROOT": demo_root, "NEW_ROOT": str(tmp_path / "imported"),
             "D": str(tmp_path / "dcp"), "model.pt": str(tmp_path / "model.pt")}
    cnr = os.path.join(os.path.dirname(sys.executable), "cnr")
    for line in lines:
        argv = [names.get(arg, arg) for arg in shlex.split(line)]
        run = subprocess.run([cnr, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert run.returncode == 0, f"{line}: exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"


def test_every_page_and_file_the_readme_and_the_docs_index_link_to_exists():
    for page in (README, os.path.join(REPO, "docs", "README.md")):
        text = open(page).read()
        links = [link.split("#", 1)[0] for link in re.findall(r"\]\(([^)]+)\)", text)]
        targets = [os.path.normpath(os.path.join(os.path.dirname(page), link)) for link in links
                   if link and not link.startswith(("http://", "https://"))]
        assert targets, page
        missing = [t for t in targets if not os.path.exists(t)]
        assert not missing, f"{page} links to {missing}"


def test_every_docs_page_is_in_the_index():
    index = open(os.path.join(REPO, "docs", "README.md")).read()
    pages = sorted(f for f in os.listdir(os.path.join(REPO, "docs")) if f.endswith(".md") and f != "README.md")
    assert [p for p in pages if f"]({p})" not in index] == []


def test_the_readmes_install_is_the_one_the_install_test_runs():
    """The README's install block is docs/install.md's, which tests/test_install.py runs in a new venv."""
    readme = [line for line in _shell_lines(open(README).read()) if line.startswith("pip ")]
    doc = [line for line in _shell_lines(open(os.path.join(REPO, "docs", "install.md")).read())
           if line.startswith("pip ")]
    assert readme and readme == doc[: len(readme)] and len(readme) == 5
