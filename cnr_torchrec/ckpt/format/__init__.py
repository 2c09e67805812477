"""The on-storage format, shared by the save and restore sides: storage, payload blobs and chunks, manifests, schema."""
