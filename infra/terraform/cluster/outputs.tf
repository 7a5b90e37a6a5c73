output "cluster_id" {
  description = "Managed Kubernetes cluster ID; `nebius mk8s cluster get-credentials --id <it> --external` writes a kubeconfig."
  value       = nebius_mk8s_v1_cluster.this.id
}

output "kube_host" {
  description = "Kubernetes API endpoint, read by ../workloads through terraform_remote_state."
  value       = nebius_mk8s_v1_cluster.this.status.control_plane.endpoints.public_endpoint
}

output "kube_cluster_ca_certificate" {
  description = "Cluster CA certificate (PEM), read by ../workloads."
  value       = nebius_mk8s_v1_cluster.this.status.control_plane.auth.cluster_ca_certificate
}

output "bucket_name" {
  description = "Object Storage bucket for inputs, outputs and models (s3://<it>/...)."
  value       = nebius_storage_v1_bucket.data.name
}

output "s3_endpoint_url" {
  description = "S3 endpoint for job files' storage.endpoint_url."
  value       = "https://storage.${var.region}.nebius.cloud"
}

output "kuberay_namespace" {
  description = "Namespace the KubeRay operator runs in."
  value       = helm_release.kuberay_operator.namespace
}
