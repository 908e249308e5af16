"""Reports across ranks: gathering every rank's report in a ``torchrun`` job (``gather``) and merging
saved per-rank files and run summaries (``rankmerge``)."""
