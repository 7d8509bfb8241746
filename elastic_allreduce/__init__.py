"""elastic-allreduce: elastic, fault-tolerant TensorFlow 2 training on Horovod's ring allreduce.

The worker-side library. It never imports :mod:`launcher` (the control plane); code both sides
need, such as the membership store, lives here.
"""

__version__ = "0.1.0.dev0"
