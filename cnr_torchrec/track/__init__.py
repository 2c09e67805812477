"""Dirty-row tracking inside FBGEMM TBE lookups."""

from cnr_torchrec.track.tracker import DirtyRowTracker

__all__ = ["DirtyRowTracker"]
