"""Change data capture: committed transactions folded into per-table batches and written to Delta in order."""
