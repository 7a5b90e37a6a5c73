"""Images in prompts: fetched, decoded and turned into the model's inputs (prompt stage)."""
