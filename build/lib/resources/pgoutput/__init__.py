"""The pgoutput wire format: tag bytes, message types, the decoder, tuple parsing, JSON rendering."""
