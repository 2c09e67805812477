"""Interop with torch.distributed.checkpoint (DCP): ``cnr export --format dcp`` and ``cnr import-dcp``.

The layout is torchtitan's, over a DistributedModelParallel's own state dicts (docs/dcp.md): the keys of
``dmp.state_dict()`` at the top level, so that ``dcp.load(dmp.state_dict(), ...)`` loads the model alone; beside
them ``optim`` (``dmp.fused_optimizer.state_dict()``: ``optim.state.<weight FQN>.<table>.momentum1``, row-wise
``[rows]`` or ``[k * rows]`` for k column shards in column order, element-wise ``[rows, dim]``), ``dense_optim``
(the dense optimizer by parameter FQN) and ``train_state`` (``{"step": N}``). A model key may not take those
names. Import also reads the older layout, which nested the model under ``model``.

**Export** writes the chunks of the tip's shard layout, as a DMP of that plan would save them. It streams:
:class:`_ExportPlanner` plans from the manifest alone and assembles a table (the chain applied to it alone) in
``resolve_data`` when DCP asks for its first chunk, once the previous one is dropped. Each chunk gets a file of
its own, since ``FileSystemWriter`` holds every tensor of a file until it closes. ``OUT`` is renamed from
``OUT.tmp-<pid>`` once DCP wrote ``.metadata``, so it only ever exists complete. **Load**: ``dcp.load``
reshards weights by FQN; :class:`DMPLoadPlanner` also maps row-wise state across column splits and leaves
optimizer state the checkpoint lacks alone. **Import** writes a baseline with
:func:`~cnr_torchrec.ckpt.save.baseline.write_baseline`: ``none`` entries, a table at a time, then the sealed
manifest. DCP's metadata pickle is read through an allow-list, other values with
``torch.load(weights_only=True)``.
"""

from cnr_torchrec.ckpt.tools.dcp.dmp_keys import DENSE_OPTIM, OPTIM, TRAIN_STATE
from cnr_torchrec.ckpt.tools.dcp.export import export_dcp
from cnr_torchrec.ckpt.tools.dcp.importer import import_dcp
from cnr_torchrec.ckpt.tools.dcp.load import DMPLoadPlanner, dense_optimizer_state_dict, load_dense_optimizer

__all__ = ["OPTIM", "DENSE_OPTIM", "TRAIN_STATE", "DMPLoadPlanner", "dense_optimizer_state_dict", "export_dcp",
           "import_dcp", "load_dense_optimizer"]
