"""``python -m elastic_allreduce.bootstrap SCRIPT [ARGS]``: one training process of a job."""

import sys

from elastic_allreduce.bootstrap.process import main

sys.exit(main())
