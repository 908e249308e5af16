"""The checking engine: a contract compiled into a generated checker (``compile``), the guard that
runs it on every call (``enforce``) and its ``torch.compile`` form (``traced``), the learnt fast
path (``memo``), nesting and call sites, the contract registry, and the violation records."""
