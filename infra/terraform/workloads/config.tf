resource "kubernetes_namespace_v1" "tokenmill" {
  metadata {
    name = var.namespace
  }
}

# The job and serve files, mounted read-only into the Ray pods and the nightly pod.
# No secrets: job files reference credentials only through ${ENV} names, and the keys file
# (digests, but still the list of who may call) comes from its own secret.
resource "kubernetes_config_map_v1" "jobs" {
  metadata {
    name      = "tokenmill-jobs"
    namespace = kubernetes_namespace_v1.tokenmill.metadata[0].name
  }
  data = {
    "nightly.yaml" = file(local.nightly_job_file)
    "serve.yaml"   = local.serve_config_yaml
  }
}

# Ray pods accept traffic only from their own namespace (workers, head, the nightly submitter)
# and from the KubeRay operator, which calls the dashboard to deploy Serve apps and poll jobs;
# the Serve port is open to the whole cluster (requests carry API keys). kubectl port-forward
# is not subject to network policies.
resource "kubernetes_network_policy_v1" "ray" {
  metadata {
    name      = "tokenmill-ray"
    namespace = kubernetes_namespace_v1.tokenmill.metadata[0].name
  }
  spec {
    pod_selector {
      match_expressions {
        key      = "ray.io/cluster"
        operator = "Exists"
      }
    }
    policy_types = ["Ingress"]
    ingress {
      from {
        pod_selector {}
      }
      from {
        namespace_selector {
          match_labels = { "kubernetes.io/metadata.name" = var.kuberay_namespace }
        }
      }
    }
    ingress {
      ports {
        port     = "8000"
        protocol = "TCP"
      }
    }
  }
}
