"""Train the tutorial's half-width AlexNet on flower photos with PyTorch Lightning."""

__version__ = "0.1.0"

# Registers strategy="dp" with Lightning, so `Trainer(strategy="dp")` and `--trainer.strategy=dp` work.
from flowers import strategies as strategies  # noqa: E402
