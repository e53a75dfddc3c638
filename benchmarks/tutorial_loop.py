"""``python benchmarks/tutorial_loop.py --data-dir DIR``: the tutorial's single-device training script, as a
whole process, less its bugs (the running loss is averaged over the epoch): time to accuracy's reference.

Each epoch prints a JSON line: epoch, val accuracy, mean train loss, seconds since the process started.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before the imports: the whole process is what a user waits for

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torchvision import datasets  # noqa: E402

from flowers.alexnet import AlexNet  # noqa: E402
from flowers.data.transforms import eval_transform, train_transform  # noqa: E402
from flowers.module import TUTORIAL_LR  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python benchmarks/tutorial_loop.py", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    parser.add_argument("--data-dir", type=Path, required=True, help="a folder with train/<class>/ and val/<class>/")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="torch's seed: the weights, the shuffles, the crops")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--num-workers", type=int, default=None, help="default: the tutorial's min(cpu, batch, 8)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    train_set = datasets.ImageFolder(str(args.data_dir / "train"), train_transform(crop_size=args.image_size))
    val_set = datasets.ImageFolder(str(args.data_dir / "val"), eval_transform(crop_size=args.image_size))
    workers = min(os.cpu_count() or 1, args.batch_size, 8) if args.num_workers is None else args.num_workers
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=workers)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, shuffle=False, num_workers=workers)
    net = AlexNet(num_classes=len(train_set.classes)).to(device)
    optimizer = torch.optim.Adam(net.parameters(), lr=TUTORIAL_LR)
    loss_function = nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        net.train()
        running_loss = 0.0
        for images, labels in train_loader:
            optimizer.zero_grad()
            loss = loss_function(net(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
        net.eval()
        correct = 0
        with torch.no_grad():
            for images, labels in val_loader:
                correct += (net(images.to(device)).argmax(dim=1) == labels.to(device)).sum().item()
        print(json.dumps({"epoch": epoch + 1, "val_acc": correct / len(val_set),
                          "train_loss": running_loss / len(train_loader),
                          "elapsed_s": round(time.perf_counter() - STARTED, 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
