"""The package's version: the tuner keeps its choices on disk per version (flash/tuning_store.py), and pyproject.toml
reads it from here."""
__version__ = "0.1.0"
