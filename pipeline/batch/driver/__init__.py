"""The batch driver: plans shards, starts the actors, schedules work units, commits parts,
reports progress, metrics and cost."""
