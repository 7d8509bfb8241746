"""The job's records in the store: keys (:mod:`.keys`), values (:mod:`.values`) and the typed
snapshot of a whole job (:mod:`.snapshot`). Pure: importing this package does no I/O."""
