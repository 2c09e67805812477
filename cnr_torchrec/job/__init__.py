"""The DLRM training job (``python -m cnr_torchrec.job.train``), its data stream, model and plots. Not part of the library."""
