"""The restore side: choosing a sound chain, applying it to the live shards, CPR partial recovery."""
