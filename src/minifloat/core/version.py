"""The package version, below every layer so that checkpoints and reports can name it."""

__version__ = "0.1.0"
