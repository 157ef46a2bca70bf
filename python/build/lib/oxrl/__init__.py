"""oxrl from Python: ``oxrl.Trainer(config).train()`` runs the ``oxrl`` binary and returns the
final metrics; ``oxrl.ray`` runs its ranks on a Ray cluster."""

from .trainer import OxrlError, Trainer, find_binary, write_toml

__all__ = ["OxrlError", "Trainer", "find_binary", "write_toml"]
__version__ = "0.1.0"
