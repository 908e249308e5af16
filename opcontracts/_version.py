"""The version of opcontracts (one place: the package, reports and generated contracts read it)."""

__version__ = "0.1.0"
