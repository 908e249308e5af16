"""The contract language below the spec: dtype names, symbolic shapes, value rules, versions and
``when`` conditions, check modes, environment-variable warnings.  Imports nothing of opcontracts
but ``errors``."""
