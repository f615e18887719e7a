"""The runs: the snapshot, the incremental run, reconciliation, the key-range walk and copy, the consistent copy, the snapshot layout choice and the ``pgcdc`` command."""
