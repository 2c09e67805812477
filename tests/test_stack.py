"""What the package says about the TorchRec stack it is imported into (cnr_torchrec/_stack.py).

The environment the suite runs in is a tested stack, so importing the package there warns of nothing. The other
cases are made real the way pip would leave them: a distribution's metadata (``NAME-VERSION.dist-info``) put
first on ``sys.path`` is what ``importlib.metadata`` reports, so a directory holding ``torchrec-1.7.0.dist-info``
stands for an installed torchrec 1.7.0, and one holding ``fbgemm_gpu-...dist-info`` for fbgemm-gpu installed
beside fbgemm-gpu-cpu. Each case imports the package in a fresh interpreter.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import subprocess
import sys

import pytest
import torch

from cnr_torchrec import _stack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fake_dist(where, name: str, version: str) -> None:
    info = where / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def _python(code: str, *, site=None, allow: bool = False) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter, with ``site`` (fake distributions) first on its path."""
    env = {k: v for k, v in os.environ.items() if k != _stack.ALLOW_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site) if site else "", ROOT) if p)
    if allow:
        env[_stack.ALLOW_ENV] = "1"
    return subprocess.run([sys.executable, "-W", "always::UserWarning", "-c", code], env=env, capture_output=True,
                          text=True, timeout=240)


def test_the_installed_stack_is_a_tested_one_and_importing_warns_of_nothing():
    f = _stack.found()
    assert f.torch == metadata.version("torch") and f.torchrec == metadata.version("torchrec")
    assert _stack.check() == (None, None), f.describe()
    run = _python("import cnr_torchrec")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "cnr_torchrec is tested on" not in run.stderr and "are both installed" not in run.stderr


def test_an_untested_torchrec_is_named_once_with_the_tested_stacks(tmp_path):
    _fake_dist(tmp_path, "torchrec", "1.7.0")
    run = _python("import cnr_torchrec, cnr_torchrec.ckpt", site=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stderr.count("cnr_torchrec is tested on") == 1, run.stderr[-2000:]
    assert "torchrec 1.7.0" in run.stderr
    for stack in _stack.TESTED:
        assert stack.pins in run.stderr
    assert _stack.ALLOW_ENV in run.stderr
    quiet = _python("import cnr_torchrec", site=tmp_path, allow=True)
    assert quiet.returncode == 0 and "cnr_torchrec is tested on" not in quiet.stderr


def test_two_fbgemm_builds_are_named_at_import_and_refused_by_checknrundmp(tmp_path):
    ours = "fbgemm-gpu-cpu" if _stack.found().fbgemm_gpu_cpu else "fbgemm-gpu"
    other = "fbgemm-gpu" if ours == "fbgemm-gpu-cpu" else "fbgemm-gpu-cpu"
    _fake_dist(tmp_path, other, metadata.version(ours))
    build = ("import torch\n"
             "from torchrec import EmbeddingBagCollection, EmbeddingBagConfig\n"
             "from cnr_torchrec import CheckNRunDMP, UnsupportedStackError\n"
             "t = EmbeddingBagConfig(name='t', num_embeddings=8, embedding_dim=4, feature_names=['f'])\n"
             "try:\n"
             "    CheckNRunDMP(EmbeddingBagCollection([t], device=torch.device('meta')), device=torch.device('cpu'))\n"
             "except UnsupportedStackError as e:\n"
             "    print('refused:', e)\n")
    run = _python(build, site=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "are both installed" in run.stderr  # the import's warning
    assert run.stdout.startswith("refused:") and "Uninstall both and install one" in run.stdout, run.stdout


@pytest.mark.parametrize("torch_cuda,gpu,fbgemm_gpu,fbgemm_cpu,cuda_model,fix", [
    (False, False, "1.9.0", None, False, "fbgemm-gpu-cpu==1.9.0"),  # a CUDA fbgemm under a CPU torch
    (True, True, None, "1.9.0", False, "fbgemm-gpu==1.9.0"),  # a CPU fbgemm where a GPU is
    (True, False, None, "1.9.0", True, "fbgemm-gpu==1.9.0"),  # ... and a model placed on it
    (True, False, None, "1.9.0", False, None),  # a CUDA torch on a CPU machine: PyPI's 2.14 is only that
])
def test_builds_that_do_not_fit_torch_are_named_with_the_fix(torch_cuda, gpu, fbgemm_gpu, fbgemm_cpu, cuda_model,
                                                              fix):
    f = _stack.Found(torch="2.14.1", torchrec="1.9.2", fbgemm_gpu=fbgemm_gpu, fbgemm_gpu_cpu=fbgemm_cpu,
                     torch_cuda=torch_cuda, gpu=gpu)
    why = _stack.mixed(f, cuda_model=cuda_model)
    assert (why is None) if fix is None else (fix in why), why


@pytest.mark.parametrize("versions,tested", [
    (("2.14.1+cu130", "1.9.0", "1.9.2"), True),
    (("2.13.0+cpu", "1.8.0", "1.8.0"), True),
    (("2.14.1", "1.8.0", "1.8.0"), False),  # fbgemm 1.8 is built for torch 2.13
    (("2.13.0", "1.8.0", "1.9.2"), False),  # torchrec 1.9 on the 1.8 stack: never run together
    (("2.15.0", "1.9.0", "1.9.2"), False),
])
def test_only_the_stacks_the_suite_ran_on_count_as_tested(versions, tested):
    torch_v, fbgemm_v, torchrec_v = versions
    f = _stack.Found(torch=torch_v, torchrec=torchrec_v, fbgemm_gpu=None, fbgemm_gpu_cpu=fbgemm_v,
                     torch_cuda=torch.version.cuda is not None, gpu=False)
    assert (_stack.untested(f) is None) == tested
