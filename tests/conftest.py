import os

# Keep each test process (and every rank it spawns) to one intra-op thread
# unless a test asks for more: CI has 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")


import pytest  # noqa: E402


@pytest.fixture(params=["cpu", "cuda_emulated"])
def backend(request):
    """The ``cnr`` ops of one backend: the CPU kernels, or the CUDA kernels under the emulation.

    Error-path tests take this fixture, so that both backends must reject the same calls
    with the same named errors and messages (one shared checker per op).
    """
    import torch

    if request.param == "cpu":
        import cnr_torchrec  # noqa: F401  (registers torch.ops.cnr)

        return torch.ops.cnr
    from cnr_torchrec._cuda_emu import load

    return load()


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A gloo process group of one, in this process (faster than spawning a rank)."""
    import torch.distributed as dist

    if dist.is_initialized():
        assert dist.get_world_size() == 1
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def publish_job(tmp_path_factory):
    """The publishing tests' training job: its root as it stood after each save (``_publish_job``)."""
    from _publish_job import saved_roots

    return saved_roots(tmp_path_factory.mktemp("publish"))


@pytest.fixture
def storage(tmp_path):
    """A Storage over a fresh root under ``tmp_path``, closed after the test."""
    from cnr_torchrec.ckpt.format.bytes.storage import Storage

    s = Storage(str(tmp_path / "root"))
    yield s
    s.close()
