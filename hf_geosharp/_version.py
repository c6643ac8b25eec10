"""The library's version, in a module of its own: the engine and the faces read it without importing the package root,
and the build reads it without importing torch."""

__version__ = "0.7.0.dev0"
