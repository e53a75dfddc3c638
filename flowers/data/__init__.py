"""Flower photos in, batches out: folders, splits, the download, the decoded cache and the training pipelines."""

__all__ = ["FlowerDataModule"]


def __getattr__(name: str):
    # On first use, not at import: `flowers download` imports this package and needs neither torch nor Lightning.
    if name == "FlowerDataModule":
        from flowers.data.datamodule import FlowerDataModule

        return FlowerDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
