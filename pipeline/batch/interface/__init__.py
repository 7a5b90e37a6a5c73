"""The named interfaces of pipeline.batch: the only batch modules pipeline.data,
pipeline.report and pipeline.serve import (.importlinter: protected)."""
