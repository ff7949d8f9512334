"""Small helpers shared by every stage: config loading, atomic file writes, hashing, provenance."""
