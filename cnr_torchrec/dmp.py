"""``CheckNRunDMP``: DistributedModelParallel with dirty-row tracking built in."""

# No `from __future__ import annotations`, and typing's Optional and List where DMP has them: the
# parameters that DistributedModelParallel also takes carry its very annotation objects, since
# TorchRec's signature check (torchrec.schema.utils.is_signature_compatible) compares annotations
# with `!=`, and neither a string nor `list[...]` equals its `List[...]` (tests/test_dropin.py).
from typing import List, Optional

import torch
from torch import nn
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.model_tracker.types import ModelTrackerConfigs
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan

from cnr_torchrec.track import DirtyRowTracker

__all__ = ["CheckNRunDMP"]


class CheckNRunDMP(DistributedModelParallel):
    """A drop-in :class:`~torchrec.distributed.DistributedModelParallel` that tracks dirty rows.

    It takes the same arguments as DistributedModelParallel, plus keyword-only
    tracking options, and owns a :class:`~cnr_torchrec.track.DirtyRowTracker` as
    ``model.dirty_tracker``. Tracking happens inside the TBE lookups, so it also works
    when a TorchRec training pipeline drives the model, including pipelines that look
    up the next batch before the current one's update. The tracker's pass over a
    training lookup's ids is also a full bounds check: an out-of-range id or a
    malformed bag layout raises a named error before the lookup runs. On CPU, where
    the user left FBGEMM's bounds-check mode at its default, FBGEMM's own check is
    skipped for those lookups.

    Args:
        module, env, device, plan, sharders, init_data_parallel, init_parameters,
        data_parallel_wrapper, model_tracker_configs: as for DistributedModelParallel.
        count_updates: keep an int32 lookup counter per row (for MFU prioritisation).
        baseline_view: also keep the "dirty since the last baseline" view.
        fuse_bounds_check: let the marking pass stand in for FBGEMM's bounds check on
            CPU (default). A mode set through ``FBGEMM_TBE_BOUNDS_CHECK_MODE``, the
            sharder's ``fused_params`` or the plan is respected either way.
        sync_free: keep host syncs out of the training step: lookup problems are
            raised at the next tracker query or save instead of in the forward.
            None (default): on for TBEs on CUDA, off on CPU.

    Raises:
        UnsupportedShardingError: a table whose kernel is not an FBGEMM TBE, or whose
            compute kernel is not a fused one (data_parallel tables excepted).
        RowIdOutOfRangeError, MalformedLookupError: from a training forward (sync-free:
            from the next query or save), for a batch with an id outside its table or
            offsets that do not fit its ids.
    """

    def __init__(
        self,
        module: nn.Module,
        env: Optional[ShardingEnv] = None,
        device: Optional[torch.device] = None,
        plan: Optional[ShardingPlan] = None,
        sharders: Optional[List[ModuleSharder[torch.nn.Module]]] = None,
        init_data_parallel: bool = True,
        init_parameters: bool = True,
        data_parallel_wrapper: Optional[DataParallelWrapper] = None,
        model_tracker_configs: Optional[ModelTrackerConfigs] = None,
        *,
        count_updates: bool = False,
        baseline_view: bool = False,
        fuse_bounds_check: bool = True,
        sync_free: bool | None = None,
    ) -> None:
        super().__init__(
            module,
            env=env,
            device=device,
            plan=plan,
            sharders=sharders,
            init_data_parallel=init_data_parallel,
            init_parameters=init_parameters,
            data_parallel_wrapper=data_parallel_wrapper,
            model_tracker_configs=model_tracker_configs,
        )
        self.dirty_tracker = DirtyRowTracker(
            self,
            count_updates=count_updates,
            baseline_view=baseline_view,
            fuse_bounds_check=fuse_bounds_check,
            sync_free=sync_free,
        )
