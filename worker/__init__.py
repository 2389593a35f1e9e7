"""Worker side: partitioning and placement, the push/pull engine, intra-node reduction."""
