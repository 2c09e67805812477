"""Publishing: committed checkpoints streamed, in order, into serving copies of the model (docs/publish.md)."""

from cnr_torchrec.publish.follower import Cursor, Follower, Update

__all__ = ["Cursor", "Follower", "Update"]
