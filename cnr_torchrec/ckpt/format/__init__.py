"""The on-storage format, shared by the save and restore sides: storage and its plugins, payload blobs and chunks,
manifests, schema."""
