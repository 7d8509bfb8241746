"""``python -m bench.soak`` (`make soak`): the soak's command line, :mod:`bench.soak.cli`."""

import sys

from bench.soak.cli import main

sys.exit(main())
