"""`python -m agent ...` = `phalanx-agent ...`."""

import sys

from agent.cli import main

sys.exit(main())
