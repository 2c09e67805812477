"""The forward hooks on each TBE that mark the rows its training lookups read.

The pre-hook passes a lookup's ids to ``cnr::mark_rows``, which sets their bits in the
TBE's bitmap (``intervals.py``), bumps their counters (``counters.py``) and records any
bad id or bag layout; the post-hook holds the lookup in flight until its update has run
(``_inflight.py``). Which of the marking pass and FBGEMM checks a lookup's bounds is
decided here too (``_bounds.py``). ``DirtyRowTracker`` describes the whole.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from cnr_torchrec import ops
from cnr_torchrec.errors import MalformedLookupError, RowIdOutOfRangeError
from cnr_torchrec.track._bounds import NO_CHECK, restore_configured_mode, takeover_mode, why_not_taken_over
from cnr_torchrec.track._inflight import InFlight, Lookup
from cnr_torchrec.track._sampling import sample_lookup
from cnr_torchrec.track.counters import TbeCounts
from cnr_torchrec.track.discovery import TrackedKernel
from cnr_torchrec.track.intervals import TbeBits
from cnr_torchrec.track.layout import ShardLayout
from cnr_torchrec.track.torchrec_types import TorchRecModule

__all__ = ["LookupHooks"]

log = logging.getLogger(__name__)


class _KernelState:
    """What the hooks of one TBE keep: its lookups' problems, its lookups in flight, and where to mark them."""

    # Variable-batch layouts whose B_offsets are kept on the device; a job has few.
    _MAX_BATCH_LAYOUTS = 64

    def __init__(self, info: TrackedKernel, bits: TbeBits, counter: TbeCounts, sync_free: bool) -> None:
        self.info = info
        self.bits = bits
        self.counter = counter
        self.sync_free = sync_free
        device = bits.bitmap.device
        # Problems of this TBE's lookups (cnr::mark_rows' record). Sync-free, they stay
        # here until a query raises them; otherwise the hook raises them at once.
        self.errors = ops.lookup_record(device)
        # Whether the record was found clean with no lookup since: a save queries the tracker
        # many times, and each read of the record is a host sync on CUDA.
        self.checked = True
        # A record for the SSU pass, whose ids the first pass has already checked.
        self.sample_errors = ops.lookup_record(device) if sync_free else None
        # Names of the tables behind each feature, for error messages only.
        ftm = getattr(info.tbe, "feature_table_map", None) or list(range(len(info.shards)))
        self.feature_tables = [info.shards[t].table for t in ftm]
        # FBGEMM's bounds-check mode of the TBE as configured, where the marking pass takes
        # that check over for the lookups it marks (see _bounds.py); None where it does not.
        self.fbgemm_bounds_check: int | None = None
        # Marked lookups whose update has not run yet, and the one the pre-hook just marked.
        self.in_flight = InFlight()
        self.marked: Lookup | None = None
        # The TBE's per-feature row layout, read once: the hook runs on every lookup.
        self.hash_size_cumsum = info.tbe.hash_size_cumsum
        # Every FBGEMM TBE has it; mark_rows refuses a None by name.
        self.rows_per_table: torch.Tensor = cast(torch.Tensor, getattr(info.tbe, "rows_per_table", None))
        self._batch_offsets: dict[tuple[int, ...], torch.Tensor] = {}

    def mark(self, lookup: Lookup, counts: torch.Tensor | None = None, errors: torch.Tensor | None = None) -> None:
        """Marks the rows of ``lookup`` with the TBE's own row layout, recording its problems in ``errors``."""
        self.checked = False
        ops.mark_rows(lookup.indices, lookup.offsets, self.hash_size_cumsum, self.rows_per_table, self.bits.bitmap,
                      counts, lookup.B_offsets, self.errors if errors is None else errors)

    def batch_offsets(self, bags_per_feature: tuple[int, ...]) -> torch.Tensor:
        """B_offsets of a variable-batch lookup, on the bitmap's device, made once per batch layout."""
        cached = self._batch_offsets.get(bags_per_feature)
        if cached is None:
            if len(self._batch_offsets) >= self._MAX_BATCH_LAYOUTS:
                self._batch_offsets.clear()
            host = torch.tensor([0, *itertools.accumulate(bags_per_feature)], dtype=torch.int64)
            bitmap = self.bits.bitmap
            if bitmap.is_cuda:
                host = host.pin_memory()  # so that the copy does not wait for the stream
            cached = self._batch_offsets[bags_per_feature] = host.to(bitmap.device, non_blocking=True)
        return cached

    def table_names(self) -> str:
        """The TBE's tables, quoted, for error messages."""
        return ", ".join(f"'{t}'" for t in dict.fromkeys(self.feature_tables))

    def raise_recorded(self, *, clear: bool) -> None:
        """Raises the first problem recorded for this TBE's lookups, as a tracker error."""
        try:
            ops.raise_lookup_errors(self.errors)  # on CUDA, a read on the host
        except (IndexError, ValueError, RuntimeError) as e:
            record = self.errors.to("cpu", copy=True)
            if clear:
                self.errors.zero_()
            raise self._lookup_error(record, e) from e

    def _lookup_error(self, record: torch.Tensor, error: Exception) -> Exception:
        bad = ops.first_bad_id(record) if isinstance(error, IndexError) else None
        if bad is not None:
            feature, bad_id, rows, count = bad
            since = " since tracking began" if self.sync_free else " in the batch"
            return RowIdOutOfRangeError(
                f"table '{self.feature_tables[feature]}' was looked up with id {bad_id}, outside the {rows} rows "
                f"this shard holds ({count} bad ids{since}); check that the input ids are below the table's "
                "num_embeddings"
            )
        return MalformedLookupError(
            f"a lookup of {self.table_names()} has a bad bag layout: {error}; offsets must start at 0 or "
            "more, never decrease, and end within the ids"
        )


class LookupHooks:
    """The marking hooks of every sharded TBE of this rank, and the per-TBE state they keep.

    Args:
        layout: this rank's TBEs.
        bits, counters: the bitmaps and counters of each TBE, in the order of ``layout.kernels``.
        fuse_bounds_check, sync_free: as ``DirtyRowTracker`` takes them.
    """

    def __init__(self, layout: ShardLayout, bits: list[TbeBits], counters: list[TbeCounts], *,
                 fuse_bounds_check: bool, sync_free: bool | None) -> None:
        self.states: list[_KernelState] = []
        self._handles: list[Any] = []
        plan_modes = layout.bounds_check_modes()
        for info, device, b, c in zip(layout.kernels, layout.devices, bits, counters):
            state = _KernelState(info, b, c, device.type == "cuda" if sync_free is None else sync_free)
            self.states.append(state)
            if not info.data_parallel:
                self._install(state, plan_modes, fuse_bounds_check)

    @property
    def sync_free(self) -> bool:
        return any(k.sync_free for k in self.states)

    @property
    def fused_bounds_check(self) -> bool:
        return any(k.fbgemm_bounds_check is not None for k in self.states)

    def check(self, indices: Iterable[int] | None = None) -> None:
        """Raises the first problem recorded by sync-free tracking on the TBEs ``indices`` (default: all)."""
        states = self.states if indices is None else [self.states[i] for i in indices]
        for state in states:
            if state.sync_free and not state.checked:
                state.raise_recorded(clear=False)
                state.checked = True

    def remark_in_flight(self) -> None:
        """Marks again the lookups whose update is still to come: it lands in the interval just begun."""
        for state in self.states:
            for lookup in state.in_flight:
                state.mark(lookup)

    def remove(self) -> None:
        """Detaches the hooks, and gives the TBEs back their configured bounds checks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for k in self.states:
            if k.fbgemm_bounds_check is not None:
                k.info.tbe.bounds_check_mode_int = k.fbgemm_bounds_check
                k.fbgemm_bounds_check = None

    def _install(self, state: _KernelState, plan_modes: dict[str, object], fuse_bounds_check: bool) -> None:
        info = state.info
        reason = why_not_taken_over(info, plan_modes, fuse_bounds_check, state.sync_free)
        if reason is None:
            state.fbgemm_bounds_check = takeover_mode(info)
        else:
            restore_configured_mode(info)  # in case an earlier tracker of this model left NONE set
            log.debug("FBGEMM keeps the bounds check of %s: %s", state.table_names(), reason)
        self._handles.append(info.tbe.register_forward_pre_hook(_pre_hook(state), with_kwargs=True))
        self._handles.append(info.tbe.register_forward_hook(_post_hook(state)))


def _pre_hook(state: _KernelState):
    fbgemm_mode = state.fbgemm_bounds_check

    def hook(module: TorchRecModule, args: tuple, kwargs: dict) -> None:
        state.marked = None
        if not (module.training and torch.is_grad_enabled()):
            if fbgemm_mode is not None:
                module.bounds_check_mode_int = fbgemm_mode  # a lookup we do not check: FBGEMM does
            return
        lookup = _lookup_of(state, args, kwargs)
        # Read at call time: counters may be enabled after the hook was registered.
        counter = state.counter
        counts, rate = counter.counts, counter.sample_rate
        sampled = counts is not None and rate is not None and rate < 1.0  # rate 1: count all, in one pass
        state.mark(lookup, None if sampled else counts)
        if not state.sync_free:
            state.raise_recorded(clear=True)  # before the lookup runs
        if fbgemm_mode is not None:
            # Every id and offset the lookup reads passed the checks above.
            module.bounds_check_mode_int = NO_CHECK
        if sampled:
            # The sample's rows are already set in the bitmap, so this pass only bumps counters
            # (re-setting a set bit changes nothing); its ids went through the checks above.
            assert rate is not None and counter.generator is not None  # sampled: a rate below 1, and its generator
            kept, kept_offsets = sample_lookup(lookup.indices, lookup.offsets, rate, counter.generator,
                                               sync_free=state.sync_free)
            state.mark(Lookup(kept, kept_offsets, lookup.B_offsets), counts, state.sample_errors)
        state.marked = lookup

    return hook


def _post_hook(state: _KernelState):
    def post_hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if state.marked is not None:
            state.in_flight.add(state.marked, output)
            state.marked = None

    return post_hook


def _lookup_of(state: _KernelState, args: tuple, kwargs: dict) -> Lookup:
    indices = kwargs["indices"] if "indices" in kwargs else args[0]
    offsets = kwargs["offsets"] if "offsets" in kwargs else args[1]
    weights = kwargs["per_sample_weights"] if "per_sample_weights" in kwargs else \
        (args[2] if len(args) > 2 else None)
    if weights is not None and weights.numel() != indices.numel():
        raise MalformedLookupError(
            f"a lookup of {state.table_names()} has {weights.numel()} per-sample weights for "
            f"{indices.numel()} ids; give one weight per id"
        )
    vbe = kwargs.get("batch_size_per_feature_per_rank")
    b_offsets = None if vbe is None else state.batch_offsets(tuple(sum(b) for b in vbe))
    return Lookup(indices, offsets, b_offsets)
