# The KubeRay operator: reconciles RayCluster / RayService objects (created by ../workloads)
# into pods, and installs their CRDs, which is why it lives in this first root module.
resource "helm_release" "kuberay_operator" {
  name             = "kuberay-operator"
  repository       = "https://ray-project.github.io/kuberay-helm/"
  chart            = "kuberay-operator"
  version          = var.kuberay_chart_version
  namespace        = var.kuberay_namespace
  create_namespace = true
  atomic           = true
  wait             = true

  # The node groups must exist before the operator pod can be scheduled.
  depends_on = [nebius_mk8s_v1_node_group.cpu]
}
