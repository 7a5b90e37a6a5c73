output "dashboard_url" {
  description = "Ray dashboard / Jobs API of the batch cluster, inside the cluster: the --address of `tokenmill submit`."
  value       = local.dashboard_url
}

output "dashboard_port_forward" {
  description = "Reach the batch dashboard from a workstation; then submit with --address http://127.0.0.1:8265."
  value       = "kubectl -n ${var.namespace} port-forward svc/${local.batch_cluster_name}-head-svc 8265:8265"
}

output "serve_url" {
  description = "OpenAI-compatible Serve endpoint inside the cluster (base URL for clients: <it>/v1)."
  value       = var.serve_enabled ? local.serve_url : null
}

output "serve_port_forward" {
  description = "Reach the Serve endpoint from a workstation at http://127.0.0.1:8000/v1."
  value       = var.serve_enabled ? "kubectl -n ${var.namespace} port-forward svc/${local.serve_name}-serve-svc 8000:8000" : null
}

output "nightly_command" {
  description = "The command the nightly CronJob runs (also the one to catch up a night by hand, with a fixed --date)."
  value       = local.nightly_command
}
