"""vlmreg's version, here so that the SDK (plugin loading names it) needs nothing from the package above it."""

__version__ = "0.1.0"
