"""What a follower serves into: the float tables of an unsharded model, or of a state_dict.

A target is found by table name. In a module, every unsharded ``EmbeddingBagCollection`` and
``EmbeddingCollection`` gives its tables' weights (``embedding_bags[name].weight``,
``embeddings[name].weight``); a state_dict gives the tensors under the names the checkpoint's
``table_fqns`` record (the training model's names). Rows are written in place, under ``no_grad``,
in the target's own dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch import nn

from cnr_torchrec.errors import ConfigError

__all__ = ["FloatTables", "float_tables"]

FloatTables = dict[str, torch.Tensor]
"""Table name -> the target's weight tensor ``[rows, dim]``."""


def float_tables(target: nn.Module | MutableMapping[str, torch.Tensor], table_fqns: Mapping[str, str]) -> FloatTables:
    """The weight tensors of ``target`` by table name.

    Raises:
        ConfigError: a module with no unsharded EmbeddingBagCollection or EmbeddingCollection, or one whose
            tables are sharded; a state_dict with none of the checkpoint's table names.
    """
    if isinstance(target, nn.Module):
        return _module_tables(target)
    found = {t: target[name] for t, name in table_fqns.items() if name in target}
    if not found:
        raise ConfigError(f"the state_dict given to follow holds none of the checkpoint's tables (it names them "
                          f"{sorted(table_fqns.values())[:4]}...); pass the training model's state_dict, or an "
                          "unsharded model")
    return found


def _module_tables(model: nn.Module) -> FloatTables:
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    out: FloatTables = {}
    for name, module in model.named_modules():
        if isinstance(module, EmbeddingBagCollection):
            out.update(_weights(module.embedding_bags, name))
        elif isinstance(module, EmbeddingCollection):
            out.update(_weights(module.embeddings, name))
        elif type(module).__name__.startswith("Sharded"):
            raise ConfigError(f"{name or 'the model'} is sharded ({type(module).__name__}); a follower serves an "
                              "unsharded model (build it as TorchRec's inference does, without "
                              "DistributedModelParallel)")
    if not out:
        raise ConfigError(f"{type(model).__name__} holds no EmbeddingBagCollection or EmbeddingCollection to serve")
    return out


def _weights(tables: Any, where: str) -> FloatTables:
    out = {}
    for table, emb in tables.items():
        weight = emb.weight
        if weight.is_meta:
            raise ConfigError(f"{where}.{table} is on the meta device; build the serving model on a real device")
        out[table] = weight
    return out
