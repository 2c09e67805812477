"""The DLRM training job (``python -m cnr_dlrm.train``), its data stream, model, plots and report
(``python -m cnr_dlrm.report``): an example user of cnr_torchrec's public API, not part of its wheel."""
