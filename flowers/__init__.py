"""Train the seed's half-width AlexNet on flower photos with PyTorch Lightning."""

__version__ = "0.1.0"
