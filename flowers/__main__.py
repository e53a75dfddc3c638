import sys

if sys.argv[1:2] == ["export"]:
    # export is plain argparse, not a LightningCLI subcommand: it builds no Trainer and needs no data.
    from flowers.export import main as export_main

    sys.exit(export_main(sys.argv[2:]))

from flowers.cli import main  # noqa: E402

sys.exit(main())
