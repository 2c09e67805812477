"""The install of docs/install.md, and the configs the package ships for ``load_config(NAME)``.

The shipped-config tests run every time: by name from outside the source tree, and as the wheel
and the sdist hold them. ``test_documented_install_in_a_new_venv`` runs the commands of
docs/install.md, as written there, in a new venv and then uses the install from another
directory; it takes several minutes (the extension is compiled), so it runs only with
``CNR_INSTALL_TEST=1``.
"""

from __future__ import annotations

import filecmp
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import time

import pytest

from cnr_torchrec import ConfigError, load_config
from cnr_torchrec.ckpt import POLICIES
from cnr_torchrec.ckpt.config_loading import shipped_config_names, shipped_config_path

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
DOC = ROOT / "docs" / "install.md"
DOC_MARKER = "tests/test_install.py runs the next block"


def documented_commands() -> list[str]:
    """The command lines of the first ``bash`` block after the marker comment of docs/install.md."""
    text = DOC.read_text()
    assert DOC_MARKER in text, f"docs/install.md lost the comment '{DOC_MARKER}' that marks the tested block"
    block = re.search(r"```bash\n(.*?)```", text.split(DOC_MARKER, 1)[1], re.S)
    assert block, "no ```bash block after the marker in docs/install.md"
    return [line.strip() for line in block.group(1).splitlines() if line.strip() and not line.lstrip().startswith("#")]


# Build outputs and venvs, left out of a tree that is not a git work tree of its own.
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv*", "build", ".cuda-build", "*.egg-info", "*.so", "*.o",
                                    "__pycache__", "out")


def copy_tree(dest: pathlib.Path) -> pathlib.Path:
    """A copy of the source tree as git sees it (tracked and unignored files: no venv, no build outputs).

    A tree that is not the top of a git work tree (the copy ``make cuda-check`` tests in, which lies in
    an ignored folder of the checkout) is copied whole, less its build outputs."""
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True, text=True)
    if top.returncode != 0 or pathlib.Path(top.stdout.strip()).resolve() != ROOT:
        shutil.copytree(ROOT, dest, symlinks=True, ignore=NOT_SOURCE)
        return dest
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.split(b"\0")
    for rel in filter(None, files):
        src = ROOT / os.fsdecode(rel)
        if not os.path.lexists(src):  # deleted in the work tree, not yet in the index
            continue
        target = dest / os.fsdecode(rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target, follow_symlinks=False)
    return dest


# ---- the portable build's tests ------------------------------------------------


def test_portable_selection_sets_up_without_the_emulation(tmp_path):
    """``make cuda-check`` runs scripts/portable_tests.py against a build with no emulated CUDA
    kernels. Against a copy of the package without them, every selected test gets its fixtures."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "cnr_torchrec", site / "cnr_torchrec",
                    ignore=shutil.ignore_patterns("_C_cuda_emu*", "__pycache__"))
    # Found ahead of anything an editable install of this tree would offer, it fails as the absent build does.
    (site / "cnr_torchrec" / "_C_cuda_emu.py").write_text("raise ImportError('not in the portable build')\n")
    work = tmp_path / "work"
    shutil.copytree(ROOT / "tests", work / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "pyproject.toml", work)
    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = subprocess.run([sys.executable, "-c", "import cnr_torchrec; print(cnr_torchrec.__file__); "
                            "from cnr_torchrec import _C_cuda_emu"], cwd=work, env=env, capture_output=True, text=True)
    assert probe.stdout.startswith(str(site)) and "ImportError" in probe.stderr, probe.stdout + probe.stderr

    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "portable_tests.py"), "--setup-only"],
                         cwd=work, env=env, capture_output=True, text=True, timeout=600)
    set_up = re.findall(r"^ +tests/\S+ \(fixtures used", run.stdout, re.M)
    assert run.returncode == 0 and len(set_up) > 100, run.stdout[-4000:] + run.stderr[-2000:]


# ---- configs by name ------------------------------------------------------------


def test_shipped_configs_are_the_policy_examples():
    """One shipped config per policy, each the same config as the repository's configs/NAME.yaml."""
    assert shipped_config_names() == sorted(POLICIES)
    for name in shipped_config_names():
        assert load_config(name) == load_config(CONFIGS / f"{name}.yaml")
        assert load_config(name).policy == name


def test_name_loads_from_outside_the_tree(tmp_path):
    """A bare name finds the package's own file whatever the working directory."""
    code = ("import os, cnr_torchrec; from cnr_torchrec.ckpt.config_loading import shipped_config_path\n"
            "cfg = cnr_torchrec.load_config('consecutive', root='/elsewhere')\n"
            "print(cfg.policy, cfg.root, os.path.dirname(cnr_torchrec.__file__), shipped_config_path('consecutive'))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    policy, root, package, path = out.stdout.split()
    assert (policy, root) == ("consecutive", "/elsewhere")
    assert path == os.path.join(package, "configs", "consecutive.yaml")


def test_unknown_name_lists_the_shipped_ones():
    with pytest.raises(ConfigError) as e:
        load_config("consecutiv")
    assert "'consecutiv' is not a config the package ships" in str(e.value)
    for name in shipped_config_names():
        assert name in str(e.value)
    with pytest.raises(ConfigError, match="is not a config the package ships"):
        shipped_config_path("")


def test_paths_stay_paths(tmp_path, monkeypatch):
    """A str ending in .yaml, a str with a separator and any pathlib.Path are read as files, relative
    to the working directory, even where a shipped config has the same stem."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "consecutive.yaml").write_text("root: /mine\npolicy: full\n")
    (tmp_path / "consecutive").write_text("root: /no-suffix\npolicy: full\n")
    assert load_config("consecutive.yaml").root == "/mine"
    assert load_config(os.path.join(".", "consecutive")).root == "/no-suffix"
    assert load_config(pathlib.Path("consecutive")).root == "/no-suffix"
    assert load_config("consecutive").policy == "consecutive"  # the shipped one, not ./consecutive
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("missing.yaml")


@pytest.mark.timeout(240)
def test_wheel_and_sdist_hold_the_configs(tmp_path):
    """The wheel's Python files (setup.py build_py) and the sdist hold each shipped config as a plain
    file with the content of configs/NAME.yaml (in the tree they are links), and the sdist holds
    every extension source, which an install from it compiles."""
    src = copy_tree(tmp_path / "src")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for args in (["build_py", "-d", str(tmp_path / "py")], ["sdist", "-d", str(tmp_path / "dist")]):
        out = subprocess.run([sys.executable, "setup.py", "-q", *args], cwd=src, env=env, capture_output=True,
                             text=True, timeout=180)
        assert out.returncode == 0, out.stdout + out.stderr
    (sdist,) = (tmp_path / "dist").glob("cnr_torchrec-*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    names = shipped_config_names()
    for tree in (tmp_path / "py", unpacked):
        shipped = tree / "cnr_torchrec" / "configs"
        assert sorted(p.stem for p in shipped.glob("*.yaml")) == names, tree
        for name in names:
            f = shipped / f"{name}.yaml"
            assert f.is_file() and not f.is_symlink(), f
            assert filecmp.cmp(f, CONFIGS / f"{name}.yaml", shallow=False), f
    csrc = sorted(p.relative_to(ROOT) for p in (ROOT / "csrc").rglob("*") if p.is_file())
    missing = [str(p) for p in csrc if not (unpacked / p).is_file()]
    assert not missing, f"the sdist lacks extension sources (MANIFEST.in): {missing}"


# ---- the documented install -----------------------------------------------------


def test_documented_commands_name_files_that_exist():
    """The tested block is pip installs only, and each requirements file it names is in the tree."""
    commands = documented_commands()
    assert commands and all(c.startswith("pip install ") for c in commands), commands
    assert commands[-1].startswith("pip install --no-build-isolation ")
    for c in commands:
        for req in re.findall(r"-r\s+(\S+)", c):
            assert (ROOT / req).is_file(), f"docs/install.md installs -r {req}, which is not in the repository"


# Runs in the new venv, from a directory outside the tree: a tiny CheckNRunDMP on one gloo rank
# marks the rows a training step looked up, and a shipped config loads by name.
USE_THE_INSTALL = r"""
import os, sys, tempfile

import torch
import torch.distributed as dist
import torchrec
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import cnr_torchrec
from cnr_torchrec import CheckNRunDMP, load_config

venv = os.path.realpath(sys.argv[1])
for module in (torch, torchrec, cnr_torchrec):
    assert os.path.commonpath([venv, os.path.realpath(module.__file__)]) == venv, module.__file__
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        tables = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=32, feature_names=["f0"])]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))

    def forward(self, kjt):
        return self.ebc(kjt).values().sum()


model = Tiny()
sharder = EmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.1})
plan = ShardingPlan({"ebc": construct_module_sharding_plan(
    model.ebc, per_param_sharding={"t0": table_wise(rank=0, compute_kernel="fused")}, local_size=1, world_size=1, device_type="cpu")})
model = CheckNRunDMP(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                     plan=plan, sharders=[sharder])
model.dirty_tracker.reset(baseline=True)  # every row is dirty until a first checkpoint
model(KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=torch.tensor([3, 7, 7]), lengths=torch.tensor([2, 1]))).backward()
assert model.dirty_tracker.dirty_rows("t0").tolist() == [3, 7], model.dirty_tracker.dirty_rows("t0")
assert load_config("consecutive").policy == "consecutive"
dist.destroy_process_group()
print("used the install:", torch.__version__, torchrec.__version__, os.path.dirname(cnr_torchrec.__file__))
"""


@pytest.mark.skipif(os.environ.get("CNR_INSTALL_TEST") != "1",
                    reason="minutes long (new venv, extension build): set CNR_INSTALL_TEST=1")
@pytest.mark.timeout(1800)
def test_documented_install_in_a_new_venv(tmp_path):
    """docs/install.md's commands, as written, in a new venv from a copy of the tree: then torchrec imports
    (its dependencies are all there), CheckNRunDMP tracks a step, and load_config finds a shipped config,
    from a directory outside the tree. The extension is built as a user builds it (no CNR_CUDA_EMU)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    src = copy_tree(tmp_path / "src")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "CNR_CUDA_EMU", "CNR_PORTABLE", "CNR_FORCE_CPU")}
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    env.setdefault("MAX_JOBS", "2")
    timings = []
    for command in documented_commands():
        start = time.monotonic()
        out = subprocess.run(["bash", "-c", command], cwd=src, env=env, capture_output=True, text=True, timeout=1200)
        timings.append(f"{time.monotonic() - start:6.1f} s  {command}")
        assert out.returncode == 0, f"`{command}` failed:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
        # In this order pip has no installed package to find unsatisfied (torchrec, which declares the CUDA
        # fbgemm-gpu, goes in after its dependencies and without a check), so it prints no resolver complaint.
        assert "dependency resolver" not in out.stderr, f"`{command}`:\n{out.stderr[-4000:]}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    start = time.monotonic()
    out = subprocess.run([str(venv / "bin" / "python"), "-c", USE_THE_INSTALL, str(venv)], cwd=elsewhere, env=env,
                         capture_output=True, text=True, timeout=300)
    timings.append(f"{time.monotonic() - start:6.1f} s  use the install from {elsewhere}")
    print("\n".join(timings))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "used the install" in out.stdout
