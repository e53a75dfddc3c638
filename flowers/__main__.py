"""``flowers`` (the console script) and ``python -m flowers``: one command line for every subcommand."""

from __future__ import annotations

import argparse
import sys

# fit/validate/test/predict are LightningCLI's (each has its own --help); export and download build no Trainer.
SUBCOMMANDS = {
    "fit": "train a model: flowers fit --config configs/quickstart.yaml",
    "validate": "score a checkpoint on the validation split",
    "test": "score a checkpoint on the data folder's test/ split",
    "predict": "classify images with a checkpoint into predictions.csv",
    "export": "write a checkpoint's network as a state_dict, ONNX or TorchScript file",
    "download": "fetch the flower photos (about 220 MB) into data/flower_photos, once",
    "serve": "serve a checkpoint or an export over HTTP, with a page to try it",
    "sweep": "search fit's settings with Optuna, each trial a fit run: flowers sweep --config configs/sweeps/…",
}


def overview() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowers", description="Train the tutorial's half-width AlexNet on flower photos with PyTorch Lightning.",
        epilog="`flowers SUBCOMMAND --help` lists a subcommand's options.",
    )
    choices = parser.add_subparsers(title="subcommands", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, text in SUBCOMMANDS.items():
        choices.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    if not words or words[0] in ("-h", "--help"):
        overview().print_help(sys.stdout if words else sys.stderr)
        return 0 if words else 2
    if words[0] not in SUBCOMMANDS and not words[0].startswith("-"):  # options before it are LightningCLI's
        print(f"flowers: error: {words[0]!r} is not a subcommand: choose from {', '.join(SUBCOMMANDS)}. "
              "`flowers --help` says what each does.", file=sys.stderr)
        return 2
    if words[0] == "export":
        from flowers.export import main as export

        return export(words[1:])
    if words[0] == "download":
        from flowers.data.download import main as download

        return download(words[1:])
    if words[0] == "serve":
        from flowers.serve import main as serve

        return serve(words[1:])
    if words[0] == "sweep":
        from flowers.sweep import main as sweep

        return sweep(words[1:])
    from flowers.cli import main as cli

    # None lets LightningCLI read sys.argv itself; given args beside a command line, it warns on every run.
    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
