"""Attaching guards to real callables: the patcher behind ``import opcontracts.patch`` and
``opcontracts.use`` (guard user callables with contracts)."""
