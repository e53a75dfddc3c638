"""Train the tutorial's half-width AlexNet on flower photos with PyTorch Lightning.

The package's face imports nothing: ``flowers --help``, ``flowers download`` and ``flowers serve --help`` answer
without loading torch or Lightning. ``strategy="dp"`` is registered with Lightning by ``flowers.strategies``,
which ``flowers.module`` imports.
"""

__version__ = "0.1.0"
