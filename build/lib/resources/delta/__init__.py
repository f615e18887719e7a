"""Delta side of the data flow: the Spark engine, snapshot writes, MERGE, schema changes, commit markers."""
