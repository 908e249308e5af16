"""Contract files shipped with opcontracts (installed as ``opcontracts.contracts``)."""
