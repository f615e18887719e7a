"""The lake: what reads and writes Delta tables through an engine session or the log itself: snapshot writes,
MERGE, schema changes, layout, commit markers, the state table, maintenance. It uses the session it is handed
and never starts an engine (``resources/engines/`` does)."""
