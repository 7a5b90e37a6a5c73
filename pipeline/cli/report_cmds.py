"""Commands registered on the shared app (filled in by the area that owns them)."""
