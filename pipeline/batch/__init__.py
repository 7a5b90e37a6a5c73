"""The batch product: a job file in, committed Parquet parts out (see run.py for the stages)."""
