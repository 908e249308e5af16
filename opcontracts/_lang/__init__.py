"""The contract language beside the spec: dtype names, symbolic shapes, value rules, versions and
``when`` conditions, check modes, environment-variable warnings.  It imports nothing of
opcontracts but ``errors`` (and ``spec``'s models for type hints only); ``spec`` builds on it."""
