"""The real torch_npu wheels as the source of truth: read them as zip files (never import
them), check contracts against them, draft contracts from them, compare releases.

========================= ==================================================================
``_source``               a ``.whl``, a folder of them or an unpacked tree -> the files read
``_schema``               the yaml's ``custom`` section (``torch.ops.npu``) -> ``OpSchema``
``_docs``                 ``_op_plugin_docs.py`` (``ast``) -> per-argument doc dtypes
``_meta``                 ``_meta_registrations.py`` (``ast``) -> ranks, dtype checks, outputs
``_bindings``             ``custom_ops.py`` (``ast``) -> ``torch_npu.X = torch.ops.npu.X``
``digest``                build / save / load / compare the digest; the library API
                          (``digest.load().release("2.14.0").schemas``, ``op_schemas``)
``verify``                contracts vs releases: (a) (b) (c) (d), schema, meta kernels
``draft``                 draft TOML contracts for ops that have none
``diff``                  what changed between two releases, per op
``cli``                   ``opcontracts wheel verify | draft | diff | digest``
========================= ==================================================================

Nothing here imports torch_npu, and parsing needs no torch (verify loads contracts, which
validates dtype names with torch).  Importing this package imports nothing else.
"""
