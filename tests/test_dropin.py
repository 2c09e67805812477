"""CheckNRunDMP is a drop-in for TorchRec's DistributedModelParallel, by TorchRec's own signature check.

TorchRec guards DMP's API with ``torchrec/schema/api_tests/test_model_parallel_schema.py``, which
applies ``torchrec.schema.utils.is_signature_compatible`` to a frozen copy of DMP's signature.
That test file is not in TorchRec's wheel; its checker is, and these tests apply it with DMP's
installed signature as the stable one, which holds every parameter of the frozen copy and more.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from torchrec.distributed import DistributedModelParallel
from torchrec.schema.utils import is_signature_compatible

from cnr_torchrec import CheckNRunDMP


def test_init_passes_torchrec_schema_check():
    """TorchRec's checker accepts CheckNRunDMP.__init__ wherever it accepts DMP's."""
    assert is_signature_compatible(
        inspect.signature(DistributedModelParallel.__init__), inspect.signature(CheckNRunDMP.__init__))


def test_forward_passes_torchrec_schema_check():
    assert is_signature_compatible(
        inspect.signature(DistributedModelParallel.forward), inspect.signature(CheckNRunDMP.forward))


def test_dmp_parameters_are_identical_and_extras_keyword_only():
    """DMP's parameters come first with its names, kinds, defaults and annotation objects; ours follow,
    keyword-only, so no positional call to DMP means something else to CheckNRunDMP."""
    dmp = list(inspect.signature(DistributedModelParallel.__init__).parameters.values())
    ours = list(inspect.signature(CheckNRunDMP.__init__).parameters.values())
    assert ours[: len(dmp)] == dmp
    extras = ours[len(dmp):]
    assert extras and all(p.kind is p.KEYWORD_ONLY for p in extras)
    assert inspect.signature(CheckNRunDMP.__init__).return_annotation is None


@pytest.mark.timeout(120)
def test_positional_call_as_for_dmp(group):
    """DMP's arguments passed positionally, in its order, build a tracked model."""
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=32, feature_names=["f0"])],
        device=torch.device("cpu"),
    )
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    model = CheckNRunDMP(ebc, env, torch.device("cpu"), None, None, True, True, None, None, count_updates=True)
    assert model.dirty_tracker.tables() == ["t0"]
