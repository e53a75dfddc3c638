import sys

from flowers.cli import main

sys.exit(main())
