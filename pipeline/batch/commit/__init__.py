"""The commit protocol: parts, the manifest, the job fingerprint."""
