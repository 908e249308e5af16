"""Module paths as the model names them: wrapper segments taken out of a qualified name.

Wrappers put themselves between a model and its submodules, so ``named_modules()`` under the
outermost module (what the NaN sentinel reports) carries their attribute names.  The incident's
report named the failing module
``_fsdp_wrapped_module.module.gpt.transformer.model.layers.2._fsdp_wrapped_module.mlp.moe``;
the model calls it ``gpt.transformer.model.layers.2.mlp.moe``.  The segments taken out:

* ``_fsdp_wrapped_module``: FSDP1 (``FullyShardedDataParallel``) around every wrapped unit
  (``torch.distributed.fsdp._common_utils.FSDP_WRAPPED_MODULE``);
* ``_checkpoint_wrapped_module``: activation checkpointing's ``CheckpointWrapper``;
* ``_orig_mod``: ``torch.compile``'s ``OptimizedModule``;
* ``module``: ``DistributedDataParallel``, Megatron's ``Float16Module`` and the like, which keep
  the model as ``.module``.  A submodule the user named ``module`` goes too: the raw path is
  always reported next to the cleaned one.

FSDP2 (``fully_shard``) changes no name: its paths come back unchanged.  Pure string work, no
torch import.
"""

from __future__ import annotations

__all__ = ["WRAPPER_SEGMENTS", "clean"]

WRAPPER_SEGMENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod",
                              "module"})


def clean(path: str | None) -> str | None:
    """``path`` without wrapper segments: ``_fsdp_wrapped_module.layers.2._fsdp_wrapped_module.mlp``
    -> ``layers.2.mlp``.  ``None`` stays ``None``; the root (``""``, or a path of wrappers only)
    is ``""``; a path that is no dotted name (the sentinel's ``Root > Leaf`` for a module not
    registered under the root) is returned as it is."""
    if not path or " " in path:
        return path
    return ".".join(s for s in path.split(".") if s not in WRAPPER_SEGMENTS)
