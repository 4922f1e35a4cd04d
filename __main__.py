"""`python -m pdserve ...` is the `pdserve` command (what the launchers run as children)."""

import sys

from pdserve.cli import main

sys.exit(main())
