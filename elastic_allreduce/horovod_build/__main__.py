"""``python -m elastic_allreduce.horovod_build``: see the package."""

import sys

from elastic_allreduce.horovod_build import main

sys.exit(main())
