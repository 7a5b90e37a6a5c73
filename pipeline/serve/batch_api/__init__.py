"""The Batch API: `/v1/files` and `/v1/batches` on the Serve endpoint, each batch a pipeline job.

batch_routes (the routes, mounted on the ingress), files (uploaded files in storage and their
validation), multipart (multipart/form-data read as it arrives), batches (batch records, the job
behind each, OpenAI's state machine) and batch_quota (per-owner quotas shared by every ingress
replica). The only Serve modules that import pipeline.batch (tests/unit/test_import_rules.py).
"""
