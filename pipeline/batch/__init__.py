"""The batch product: a job file in, committed Parquet parts out.

In the order a row meets them, and below what uses them:

    columns.py   the row contract: the column names every stage shares (imports nothing)
    units.py     what the driver and the workers exchange: shards, work units, part records
    session.py   the Ray session a job runs in
    commit/      the exactly-once protocol: parts, ledger, manifest, lease, duplicates
    metrics.py   per-actor and per-job counters
    stages/      read/ (formats, Ray Data sources and their staging) → prompts → generate
                 (the engine actor) → rows (one row's sampling and outcome) → schema
    driver/      run (the only place the stages are chained), scheduler, shards, plan,
                 cluster, placement, budget, occupancy, progress, OpenAI export files, demo
    interface/   what the rest of the pipeline may use of batch: dataset (a Ray Data
                 processor's needs), output (committed output), batch_api (the Batch API's)

The layers (interface over driver over stages over metrics over commit over session and units
over columns) are import-linter contracts in pyproject.toml.
"""
