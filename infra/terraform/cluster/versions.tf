# Root module 1 of 2: the Nebius Managed Kubernetes cluster, its node groups, the Object
# Storage bucket and the KubeRay operator. Apply it before ../workloads: the workloads use the
# RayCluster/RayService custom resources, whose CRDs this module installs, and
# kubernetes_manifest needs CRDs to exist at plan time.

terraform {
  required_version = ">= 1.6"

  required_providers {
    nebius = {
      # Nebius publishes the provider from its own registry mirror (namespace/type nebius/nebius).
      source  = "terraform-provider.storage.eu-north1.nebius.cloud/nebius/nebius"
      version = ">= 0.5"
    }
    helm = {
      source  = "hashicorp/helm"
      version = "~> 3.0"
    }
  }
}

provider "nebius" {
  domain = var.nebius_api_domain
}

# Helm talks to the cluster created here, authenticated with a short-lived IAM token
# (export TF_VAR_iam_token=$(nebius iam get-access-token)); nothing long-lived is stored.
provider "helm" {
  kubernetes = {
    host                   = nebius_mk8s_v1_cluster.this.status.control_plane.endpoints.public_endpoint
    cluster_ca_certificate = nebius_mk8s_v1_cluster.this.status.control_plane.auth.cluster_ca_certificate
    token                  = var.iam_token
  }
}
