"""FBGEMM's software cache in front of a ``fused_uvm_caching`` TBE, as checkpoints must see it.

With ``EmbeddingLocation.MANAGED_CACHING`` a TBE keeps hot rows in an HBM cache
(``lxu_cache_weights``) in front of its UVM weights, and training updates the rows
there: ``split_embedding_weights()`` reads and writes ``weights_uvm`` only. So a save
must write the cache back first (``flush()``), and a restore must drop the cache's
lines afterwards (``reset_cache_states()``), or the next eviction or flush would
overwrite the restored rows with stale ones. TorchRec does the same around its state
dicts: its kernels ``flush()`` before ``state_dict`` and ``purge()`` after a load.

Only weights are cached; optimizer states live in UVM, outside the cache. A TBE
without a cache (every other kernel, and every TBE on CPU) has an empty
``lxu_cache_weights``, and the calls below cost it nothing.

Order with prefetching pipelines (``TrainPipelinePrefetch``): a flush only writes
lines back, so a save between steps leaves a prefetch in flight valid; a restore
drops every line, including those a prefetch placed for the next batch, so, as with
TorchRec's ``load_state_dict``, restore and recover with no prefetch in flight (at the
start of a job, or after a failure, before the pipeline is filled again).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from cnr_torchrec.track.torchrec_types import TorchRecModule

__all__ = ["flush_caches", "has_cache", "invalidate_caches", "why_cache_inexact"]


def has_cache(tbe: TorchRecModule) -> bool:
    """Whether ``tbe`` holds rows in a software cache (FBGEMM's own test: a non-empty cache)."""
    cache = getattr(tbe, "lxu_cache_weights", None)
    return isinstance(cache, torch.Tensor) and cache.numel() > 0


def flush_caches(tbes: Iterable[TorchRecModule]) -> None:
    """Writes every cached row back to the TBE's weights, before they are read for a save."""
    for tbe in tbes:
        if has_cache(tbe):
            tbe.flush()


def invalidate_caches(tbes: Iterable[TorchRecModule]) -> None:
    """Drops every cached row, after the TBE's weights were written by a restore or recovery."""
    for tbe in tbes:
        if has_cache(tbe):
            tbe.reset_cache_states()


def why_cache_inexact(tbe: TorchRecModule) -> str | None:
    """Why checkpoints of ``tbe`` could not be exact, or None when they can.

    A cache wider than the weights (an fp32 cache over fp16 weights) trains at the
    cache's precision, while a flush rounds, stochastically where the TBE asks for it,
    to the weights' precision: a save would hold other values than the ones the model
    trains on. A cache as wide as the weights, or narrower, is exact: the cache holds
    the rows' true values and a flush converts them without loss.
    """
    if not has_cache(tbe):
        return None
    weights = getattr(tbe, "weights_uvm", None)
    cache = tbe.lxu_cache_weights
    if not isinstance(weights, torch.Tensor) or weights.numel() == 0:
        return None
    if cache.element_size() > weights.element_size():
        return (f"its cache holds {cache.dtype} rows over {weights.dtype} weights, so a save (which writes the "
                "cache back at the weights' precision) would not hold the values the model trains on")
    return None
