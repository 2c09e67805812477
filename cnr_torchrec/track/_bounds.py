"""Who checks a tracked lookup's bounds: FBGEMM's ``bounds_check_indices``, or the marking pass.

``cnr::mark_rows`` reads every id and bag offset of a lookup and rejects what
FBGEMM's check in FATAL mode rejects, so for the CPU lookups it marks it can stand
in for that check, which costs about three times as much there. It does so only
where the user left the mode to FBGEMM's default: a mode set through
``FBGEMM_TBE_BOUNDS_CHECK_MODE``, the sharder's ``fused_params`` or a table's
``ParameterSharding.bounds_check_mode`` is the user's choice and stays in force.
"""

from __future__ import annotations

import os

from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

from cnr_torchrec.track.discovery import TrackedKernel

__all__ = ["ENV_MODE", "NO_CHECK", "restore_configured_mode", "takeover_mode", "why_not_taken_over"]

ENV_MODE = "FBGEMM_TBE_BOUNDS_CHECK_MODE"
NO_CHECK = BoundsCheckMode.NONE.value
# TBE attribute: its bounds_check_mode_int as built. Kept on the TBE, so that a second
# tracker of the same model reads the configured mode and not the NONE that the first
# one set for a training lookup.
_CONFIGURED = "_cnr_configured_bounds_check_mode"


def why_not_taken_over(
    info: TrackedKernel, plan_modes: dict[str, object], enabled: bool, sync_free: bool
) -> str | None:
    """Why FBGEMM keeps checking this TBE's lookups, or None when the marking pass may take over.

    Args:
        info: the TBE and its shards.
        plan_modes: ``ParameterSharding.bounds_check_mode`` of each table (None: unset).
        enabled: the tracker's ``fuse_bounds_check`` option.
        sync_free: whether the TBE's lookups are tracked sync-free, so that their
            problems are raised only after they have run.
    """
    if not enabled:
        return "fuse_bounds_check=False"
    if sync_free:
        return "sync-free tracking raises a lookup's problems after the lookup has run"
    if info.tbe.hash_size_cumsum.device.type != "cpu":
        return "the TBE is not on CPU (FBGEMM's GPU check is cheap and stays on)"
    if not isinstance(getattr(info.tbe, "bounds_check_mode_int", None), int):
        return "the TBE has no per-call bounds-check mode"
    if os.environ.get(ENV_MODE) is not None:
        return f"{ENV_MODE} is set"
    fused = getattr(info.kernel.config, "fused_params", None) or {}
    if fused.get("bounds_check_mode") is not None:
        return "the sharder's fused_params set bounds_check_mode"
    explicit = sorted(s.table for s in info.shards if plan_modes.get(s.table) is not None)
    if explicit:
        return f"the plan sets bounds_check_mode for {explicit}"
    return None


def takeover_mode(info: TrackedKernel) -> int:
    """The TBE's bounds-check mode as configured, remembered on the TBE the first time it is read."""
    mode = getattr(info.tbe, _CONFIGURED, None)
    if mode is None:
        mode = int(info.tbe.bounds_check_mode_int)
        setattr(info.tbe, _CONFIGURED, mode)
    return mode


def restore_configured_mode(info: TrackedKernel) -> None:
    """Gives the TBE back its configured mode if a tracker has ever remembered one."""
    mode = getattr(info.tbe, _CONFIGURED, None)
    if mode is not None:
        info.tbe.bounds_check_mode_int = mode
