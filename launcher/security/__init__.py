"""TLS material and etcd authentication for a job, and the ``elastic-run security`` commands."""
