"""The observer layer over the patch's guards (``layer``) and what the observers share: judging
outputs against a reference (``judge``), findings, call statistics, contract-file output,
``nn.Module`` paths."""
