"""The shard format: schema, writer, reader, manifest and verification (see shards/FORMAT.md)."""
