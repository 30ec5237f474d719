"""Xronos: the shared package (command line and the contracts both sides import)."""

__version__ = "0.1.0"
