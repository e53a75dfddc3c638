from flowers.data.datamodule import FlowerDataModule

__all__ = ["FlowerDataModule"]
