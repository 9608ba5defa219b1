"""spmdkit's version (the package face re-exports it as ``spmdkit.__version__``; pyproject.toml
states the same)."""

__version__ = "0.1.0"
