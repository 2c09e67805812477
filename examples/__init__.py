"""Small example users of cnr_torchrec, beside the library and not in its wheel (README.md)."""
