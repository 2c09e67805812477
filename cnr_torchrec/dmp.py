"""``CheckNRunDMP``: DistributedModelParallel with dirty-row tracking built in."""

# No `from __future__ import annotations`, and typing's Optional and List where DMP has them: the
# parameters that DistributedModelParallel also takes carry its very annotation objects, since
# TorchRec's signature check (torchrec.schema.utils.is_signature_compatible) compares annotations
# with `!=`, and neither a string nor `list[...]` equals its `List[...]` (tests/test_dropin.py).
import contextlib
import logging
import os
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
from torchrec.distributed.model_tracker.types import ModelTrackerConfigs
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan

from cnr_torchrec import _exit, _stack
from cnr_torchrec.deferred_init import DeferredInit
from cnr_torchrec.errors import ConfigError
from cnr_torchrec.track import DirtyRowTracker

__all__ = ["CheckNRunDMP"]

log = logging.getLogger(__name__)

_SHARE_STORE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def _refuse_unrestartable_gloo_group() -> None:
    """Refuses a gloo group that torchrun's restarts of this job could not start again (pytorch/pytorch#135712).

    torchrun's agent hosts the rendezvous TCPStore and hands it to its workers
    (``TORCHELASTIC_USE_AGENT_STORE=True``: the c10d rendezvous of ``--standalone`` and ``--rdzv-backend
    c10d`` unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, and the static rendezvous always). The store
    outlives the workers, and a group that ``init_process_group`` rendezvoused itself (``env://`` or
    ``tcp://``) keeps its keys there under a prefix that is the same in every incarnation. A restarted
    rank then reads the dead group's gloo addresses and fails in ``connectFullMesh``, or hangs there
    until the group's timeout. The c10d rendezvous shares its store since torch 2.5 (pytorch/pytorch#128096);
    with torch 2.13 on 2 local ranks, 2 restarts of 3 failed so under it, and 3 of 3 under the static
    rendezvous. The first start works, so the job would only find out at its first
    failure: it is refused here, before any training step, when restarts are allowed
    (``TORCHELASTIC_MAX_RESTARTS`` > 0). A group built on a store the application passed in (whose keys
    may carry the round, as ``cnr_dlrm.launch`` does) is left alone, as is any group outside torchrun.

    Raises:
        ConfigError: the group is gloo, torchrun shares its store, restarts are allowed, and the group's
            keys are the same in every incarnation; the message gives the ways out.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    try:
        restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return
    if restarts <= 0 or "gloo" not in str(dist.get_backend()).lower():
        return
    from torch.distributed import distributed_c10d

    init_method = getattr(distributed_c10d, "_default_pg_init_method", None)
    if init_method is None or init_method.startswith("file://"):
        return  # a store the application built, or a file rendezvous: not torchrun's store as it is
    static = os.environ.get(_SHARE_STORE_VAR) == "1"
    fix = (f"{_SHARE_STORE_VAR}=1 is set, but this rendezvous shares its store anyway (the static rendezvous, "
           "torchrun's default without --standalone or --rdzv-backend, ignores it): launch with --rdzv-backend "
           "c10d (or --standalone on one node) and keep the variable set"
           if static else
           f"launch with {_SHARE_STORE_VAR}=1 in torchrun's environment, with --standalone or --rdzv-backend c10d, "
           "so that each restart gets a new store (the static rendezvous, torchrun's default without those "
           "flags, ignores the variable)")
    raise ConfigError(
        f"CheckNRunDMP: this gloo process group cannot be started again by torchrun's restarts "
        f"(TORCHELASTIC_MAX_RESTARTS={restarts}): torchrun keeps its rendezvous store across restarts "
        f"(TORCHELASTIC_USE_AGENT_STORE=True), and init_process_group({init_method!r}) keeps the group's keys "
        "there under a prefix that every incarnation shares, so a restarted rank reads the dead group's "
        "addresses and fails or hangs in gloo's connectFullMesh (pytorch/pytorch#135712). To fix it, "
        f"{fix}; or give init_process_group a store whose keys carry the restart's round "
        "(dist.PrefixStore, as cnr_dlrm/launch.py does); or launch with --max-restarts 0"
    )


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
        will_restore: the job restores next, so the fused tables' initial values are not drawn as the
            model is built (:mod:`cnr_torchrec.deferred_init`): True, or a checkpoint root (a path, a URL
            or a :class:`~cnr_torchrec.ckpt.CheckpointConfig`), which defers only when it holds a committed
            checkpoint on every rank's view (a collective of the default group, like DMP's construction).
            The values are drawn, bit for bit as an eager build draws them, if anything needs them before
            a restore overwrites them. False (default): drawn as TorchRec draws them.

    Attributes:
        deferred_init: the :class:`~cnr_torchrec.deferred_init.DeferredInit` of a model built with
            ``will_restore``, None otherwise.

    Raises:
        ConfigError: a gloo group under torchrun that no restart could start again (its keys in
            torchrun's shared store, restarts allowed): pytorch/pytorch#135712. The message says how
            to launch instead (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``).
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
        will_restore: object = False,
    ) -> None:
        _refuse_unrestartable_gloo_group()  # before any collective: a restart of this job would hang
        _stack.refuse_mixed_build(cuda_model=device is not None and torch.device(device).type == "cuda")
        _exit.register()  # the job's collective threads settle before the interpreter finalizes (_exit.py)
        deferred = DeferredInit()
        with deferred.recording() if _defers(will_restore) else contextlib.nullcontext():
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
        self.deferred_init: Optional[DeferredInit] = deferred if deferred.pending else None
        if self.deferred_init is not None:
            self._first_use = self.register_forward_pre_hook(lambda _module, _args: self.materialize_init())
        self.dirty_tracker = DirtyRowTracker(
            self,
            count_updates=count_updates,
            baseline_view=baseline_view,
            fuse_bounds_check=fuse_bounds_check,
            sync_free=sync_free,
        )

    def materialize_init(self) -> None:
        """Draws the tables' initial values that ``will_restore`` deferred, if a restore has not overwritten them
        (a no-op otherwise). The Checkpointer, ``state_dict()`` and the first forward call it; call it before
        reading or writing the weights some other way (values written before it are drawn over). Collective
        where the model has data_parallel tables (TorchRec broadcasts rank 0's): every rank calls it at once."""
        deferred = self.deferred_init
        if deferred is None:
            return
        deferred.materialize()
        self.deferred_init = None
        self._first_use.remove()

    def state_dict(
        self,
        destination: Optional[Dict[str, Any]] = None,
        prefix: str = "",
        keep_vars: bool = False,
    ) -> Dict[str, Any]:
        """As DistributedModelParallel's, after the deferred initial values are drawn (what it returns may be
        read: a DCP save)."""
        self.materialize_init()
        return super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)


def _defers(will_restore: object) -> bool:
    """Whether ``CheckNRunDMP(will_restore=...)`` defers: True, or a root that holds a committed checkpoint as
    every rank of the default group sees it (a collective then)."""
    if isinstance(will_restore, bool):
        return will_restore
    from cnr_torchrec.ckpt.config import CheckpointConfig
    from cnr_torchrec.ckpt.format.commits import committed_ids
    from cnr_torchrec.ckpt.tools.root import open_storage

    if isinstance(will_restore, CheckpointConfig):
        root, options = will_restore.root, will_restore.storage_options
    elif isinstance(will_restore, (str, os.PathLike)):
        root, options = os.fspath(will_restore), None
    else:
        raise ConfigError(f"CheckNRunDMP: will_restore={will_restore!r} is not a bool, a checkpoint root (a path or "
                          "a URL) or a CheckpointConfig")
    try:
        storage = open_storage(root, options)
        try:
            found = bool(committed_ids(storage))
        finally:
            storage.close()
    except Exception as e:  # noqa: BLE001 - a root that cannot be read now will not restore: draw eagerly
        log.info("will_restore: %s cannot be listed (%s: %s): the tables are initialised as they are built",
                 root, type(e).__name__, e)
        found = False
    if dist.is_available() and dist.is_initialized():
        agreed = torch.tensor([int(found)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        found = bool(agreed.item())
    return found
