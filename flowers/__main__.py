"""``python -m flowers`` and the ``flowers`` command: LightningCLI's subcommands, plus ``export``."""

import sys


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    if words[:1] == ["export"]:
        # export is plain argparse, not a LightningCLI subcommand: it builds no Trainer and needs no data.
        from flowers.export import main as export_main

        return export_main(words[1:])
    from flowers.cli import main as cli

    # None lets LightningCLI read sys.argv itself; given args beside a command line, it warns on every run.
    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
