"""The README's commands, as a newcomer runs them: every ``cnr`` line of its shell blocks, against the root of the
demo job (``configs/demo.yaml``, shortened), with the README's placeholders (``ROOT``, ``D``, ``NEW_ROOT``, ``COPY``,
``SERVING``) and its
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


@pytest.mark.long
@pytest.mark.timeout(600)
def test_the_readmes_cnr_commands_run_against_the_demos_root(demo_root, tmp_path):
    lines = _cnr_lines(open(README).read())
    assert len(lines) >= 6, lines  # the demo's two, and the six of "The cnr command"
    names = {DEMO_ROOT: demo_root, "ROOT": demo_root, "NEW_ROOT": str(tmp_path / "imported"),
             "D": str(tmp_path / "dcp"), "model.pt": str(tmp_path / "model.pt"), "COPY": str(tmp_path / "copy"),
             "SERVING": str(tmp_path / "serving")}
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


# ---- every command and path of the README and docs/ -----------------------------

PAGES = [README] + sorted(os.path.join(REPO, "docs", f) for f in os.listdir(os.path.join(REPO, "docs"))
                          if f.endswith(".md"))
TOP_DIRS = ("benchmarks", "cnr_dlrm", "cnr_torchrec", "configs", "csrc", "docs", "examples", "scripts", "stacks", "tests")


def _block_lines(page: str) -> list[str]:
    """Every line of every fenced block of a page, continuation lines joined."""
    blocks = re.findall(r"^```[\w-]*\n(.*?)^```", open(page).read(), re.S | re.M)
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]


def _code(page: str) -> list[str]:
    """Every inline code span and every line of every fenced block of a page."""
    prose = re.sub(r"^```[\w-]*\n.*?^```", "", open(page).read(), flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", prose) + _block_lines(page)


def _expand_braces(path: str) -> list[str]:
    """``a/{b,c}.json`` -> ``a/b.json``, ``a/c.json`` (one level, as the docs write them)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in _expand_braces(path[:m.start()] + alt + path[m.end():])]


def test_every_repository_path_the_docs_name_exists():
    """A path under one of the repository's folders, in a code span or block of any page, names files that exist
    (``*`` and ``{a,b}`` as a shell expands them; built files such as ``cnr_torchrec/_C*.so`` included)."""
    import glob

    pattern = re.compile(r"(?<![\w/.-])((?:%s)/[\w./*{},-]*[\w*}])" % "|".join(TOP_DIRS))
    missing, seen = [], 0
    for page in PAGES:
        for code in _code(page):
            for path in pattern.findall(code):
                seen += 1
                if not all(glob.glob(os.path.join(REPO, p)) for p in _expand_braces(path)):
                    missing.append(f"{os.path.relpath(page, REPO)}: {path}")
    assert seen > 100 and not missing, missing


def test_every_make_target_the_docs_name_exists():
    targets = set(re.findall(r"^([\w-]+):", open(os.path.join(REPO, "Makefile")).read(), re.M))
    named = {(os.path.relpath(page, REPO), t) for page in PAGES for code in _code(page)
             for t in re.findall(r"(?:^|[\s;&(])make ([a-z][\w-]*)", code)}
    assert len(named) > 10 and not [n for n in named if n[1] not in targets], sorted(n for n in named
                                                                                      if n[1] not in targets)


def test_every_cnr_command_the_docs_show_exists():
    """Each ``cnr`` command of the README and docs/, in a block or a code span, names a subcommand the CLI has and
    only flags that subcommand declares; each one in a shell block parses as written."""
    import argparse

    from cnr_torchrec.cli import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    bad, seen = [], 0
    for page in PAGES:
        shell = {code.split(" #", 1)[0].strip() for code in _block_lines(page)}
        for code in _code(page):
            line = code.split(" #", 1)[0].strip()
            if not re.match(r"(\.venv/bin/)?cnr [a-z][\w-]*( |$)", line) or "..." in line:  # not its output
                continue
            seen += 1
            argv = shlex.split(line.replace("[", " ").replace("]", " "))[1:]  # usage lines: [--flag N]
            where = f"{os.path.relpath(page, REPO)}: {line}"
            if argv[0] not in subs:
                bad.append(where)
                continue
            flags = {o for a in subs[argv[0]]._actions for o in a.option_strings}
            bad += [f"{where} ({arg})" for arg in argv if arg.startswith("-") and arg.split("=")[0] not in flags]
            if line in shell and "[" not in line:
                try:
                    parser.parse_args(argv)
                except SystemExit:
                    bad.append(where)
    assert seen > 10 and not bad, bad


def test_every_benchmark_flag_the_docs_show_is_declared():
    """``benchmarks/X.py --flag`` in the README and docs/: X declares ``--flag`` (each script's argparse lists its
    flags literally)."""
    bad, seen = [], 0
    for page in PAGES:
        for code in _code(page):
            for script, args in re.findall(r"(benchmarks/\w+\.py)((?: +[^\s|;&]+)*)", code):
                source = open(os.path.join(REPO, script)).read()
                for helper in re.findall(r"^from (\w+) import", source, re.M):  # e.g. bench_dist's shared flags
                    if os.path.exists(os.path.join(REPO, "benchmarks", f"{helper}.py")):
                        source += open(os.path.join(REPO, "benchmarks", f"{helper}.py")).read()
                for flag in re.findall(r"(?<!\S)(--[a-z][\w-]*)", args):
                    seen += 1
                    if f'"{flag}"' not in source:
                        bad.append(f"{os.path.relpath(page, REPO)}: {script} {flag}")
    assert seen > 10 and not bad, bad
