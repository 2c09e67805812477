"""The format's bytes: storage over torchsnapshot's plugins, the integrity of what is stored (digests, keyed
seals), a rank's payload as blobs in chunks, and an entry's rows read by byte range and checked by CRC-32C. The
records that describe them (``Blob``, ``Chunk``, ``Payload``) are the format's (``format/manifest.py``)."""
