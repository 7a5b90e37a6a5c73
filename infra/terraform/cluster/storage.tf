locals {
  bucket_name = var.bucket_name != "" ? var.bucket_name : "${var.name}-${replace(var.parent_id, "project-", "")}"
}

# Inputs (in/<date>/), outputs (out/<date>/) and model artifacts (models/) of every job.
# Output parts are single PUTs or multipart uploads committed by a manifest; a writer killed in
# the middle of a multipart upload leaves invisible parts that cost money until aborted.
resource "nebius_storage_v1_bucket" "data" {
  parent_id         = var.parent_id
  name              = local.bucket_name
  labels            = var.labels
  versioning_policy = "DISABLED"

  lifecycle_configuration = {
    rules = [{
      id     = "abort-incomplete-multipart-uploads"
      status = "ENABLED"
      filter = { prefix = "" }
      abort_incomplete_multipart_upload = {
        days_after_initiation = var.abort_incomplete_multipart_days
      }
    }]
  }
}
