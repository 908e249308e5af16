"""Installed by ``opcontracts run --emulate`` for the Python processes its script starts.

``run --emulate`` puts this folder first on ``PYTHONPATH`` and names the profile in
``OPCONTRACTS_EMULATE_CHILD``: a worker a script spawns (``torch.multiprocessing`` spawn or
forkserver, ``subprocess`` running python, torchrun's ranks) is a fresh interpreter in which
``import torch_npu`` would find nothing; this installs the same emulation there at start-up, as
the parent has it.  Then the ``sitecustomize`` this one hides (the next on ``sys.path``) runs,
as it would have.  A failure here is a warning, never the end of the child.
"""

import importlib.machinery
import importlib.util
import os
import sys
import warnings


def _install() -> None:
    profile = os.environ.get("OPCONTRACTS_EMULATE_CHILD")
    if not profile:
        return
    try:
        from opcontracts import emulation

        if not emulation.installed():
            emulation.install(profile, device=True)
    except Exception as exc:  # noqa: BLE001 - the child runs on, without the emulation
        warnings.warn(f"opcontracts: the emulation ({profile}) could not be installed in this "
                      f"process: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=1)


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - as Python itself reports a failing sitecustomize
        warnings.warn(f"sitecustomize {spec.origin}: {type(exc).__name__}: {exc}",
                      RuntimeWarning, stacklevel=1)


_chain()
_install()
