# The batch cluster: `tokenmill submit` (by hand or from the nightly CronJob) sends jobs to its
# head. The head runs no engines (num-cpus 0); GPU workers come and go with the Ray autoscaler,
# which asks for pods, which the GPU node group's autoscaler turns into nodes.
resource "kubernetes_manifest" "batch_cluster" {
  manifest = {
    apiVersion = "ray.io/v1"
    kind       = "RayCluster"
    metadata = {
      name      = local.batch_cluster_name
      namespace = kubernetes_namespace_v1.tokenmill.metadata[0].name
    }
    spec = {
      rayVersion              = var.ray_version
      authOptions             = local.auth_options
      enableInTreeAutoscaling = true
      autoscalerOptions       = local.autoscaler_options
      headGroupSpec           = local.head_group
      workerGroupSpecs = [{
        groupName      = "gpu"
        replicas       = var.batch_min_workers
        minReplicas    = var.batch_min_workers
        maxReplicas    = var.batch_max_workers
        rayStartParams = {}
        template       = local.gpu_worker_template
      }]
    }
  }
}
