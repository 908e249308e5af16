"""What the command line runs: ``opcontracts run`` (``run``), ``opcontracts probe`` (``probe_cli``),
and the demo (``demo``, its model ``demo_model`` and its distributed half ``demo_dist``)."""
