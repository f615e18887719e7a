"""PostgreSQL side of the data flow: connections, the replication client and stream, slots, catalog, preflight, COPY."""
