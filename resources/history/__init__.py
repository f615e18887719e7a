"""History: the changelog and SCD2 versions of a table, written beside the drain (``changelog``, ``scd2``,
``apply``, the SCD2 MERGE in ``scd2_merge``) and read back as of an LSN or a time (``as_of``)."""
