"""`make soak`: a seeded random schedule of faults, of every kind, against one real job.

The job is the CNN digits example (examples/cnn_digits.py: exactly-once data, a fixed global
batch, the sample audit) on test hosts (tests/helpers/testhosts.py: network namespaces on one
bridge, so root only): host h1 runs a 3-member etcd cluster, the leading launcher and a standby
launcher; worker hosts h2..h7 each run at most one bare ``elastic-run join`` node (one training
process each). The same job runs twice on the same hosts and etcd: clean (no fault), then under
the schedule. The fault kinds, each about equally often, in a seeded order:

- ``kill``: SIGKILL of a training process (the launcher restarts it);
- ``stop``: SIGSTOP of a training process; half the time SIGCONT after 0.2-0.35 s (a stall),
  else held until its agent kills it (a hang), then SIGCONT;
- ``leave``: SIGTERM of an agent, whose node leaves gracefully;
- ``join``: ``elastic-run join`` of a new node on a free host;
- ``takeover``: SIGKILL of the leading launcher; the standby takes the job over;
- ``adopt``: the standby stopped, the leader SIGKILLed and the same ``run`` command started
  again 4-5.5 s later (past the lease TTL), which adopts the job;
- ``etcd_restart``: every etcd member stopped (SIGTERM), then all started again;
- ``member_kill``: SIGKILL of one etcd member (half the time the leader), restarted 2-6 s later;
- ``quorum_loss``: two members (the leader and one more) SIGSTOPped for 18-22 s, then SIGCONTed
  (the standby stays: it may take the job over as etcd returns, every lease expired, and
  must wait for the ring's nodes; ``--no-standby-in-outages`` stops it before and starts it after);
- ``partition``: a worker host's link cut (a pulled cable) for 5-8 s (at least until
  its rank stopped): its node fences itself
  and rejoins once the link is back.

The job is kept healthy between faults: each fault first waits until every rank of the newest
ring steps, at least 2 of them; after it the pool is topped up to 3 nodes with new joins and a
new standby replaces one that took over; every etcd member runs again before the next fault. A
fault takes one rank of a ring whose every rank has synced, so the committed state always
survives (``--min-workers 1``: the survivors re-form at once, whatever their number). Fault i
waits until the job has trained i/N of 85 % of its epochs, so the faults are spread over the
run and the job keeps epochs in hand for a schedule that falls behind.

Recovery of a fault: from the fault until every rank of a ring has stepped again (printed two
audit lines after it). For faults that change the ring (kill, hang, leave, join, partition) the
ring must be one formed after the fault (for a join one that holds the new node, for a leave or
cut one without the node); for the others (a stall, launcher and etcd faults, through which
training goes on) any ring.

Writes bench/results/soak.json, the "Soak" section of bench/RESULTS.md (bench/soak/report.py)
and every output line of both jobs to bench/results/soak.log. Everything it starts -- the
namespaces, every process, the etcd data, the audit logs -- is removed at the end, also on a
failure or Ctrl-C.

The parts, one module each: settings (the job's shape, the fault kinds, every limit), schedule
(the seeded plan of faults and the record of each), hosts (the network namespaces and the etcd
cluster on host 0), tracker (the job seen from outside: output and audit lines), job (the
processes a run starts and keeps up), faults (making each kind and timing its recovery),
figures (one run's figures), summary (the whole soak's verdict), report (the Soak section of
bench/RESULTS.md), cli (``python -m bench.soak``).
"""
