"""Version of the package, kept in one place."""

__version__ = "0.2.0"
