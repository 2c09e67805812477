"""The save side: the planner, staging to host, the background writer, the commit protocol, retention and compaction."""
