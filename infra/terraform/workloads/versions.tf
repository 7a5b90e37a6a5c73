# Root module 2 of 2: everything that runs on the cluster built by ../cluster — the batch
# RayCluster, the Serve RayService, the nightly CronJob and their config. Apply ../cluster
# first: the RayCluster and RayService CRDs must exist when this module is planned.

terraform {
  required_version = ">= 1.6"

  required_providers {
    kubernetes = {
      source  = "hashicorp/kubernetes"
      version = "~> 2.31"
    }
  }
}

# The cluster's endpoint and CA come from the first module's state; authentication is a
# short-lived IAM token (export TF_VAR_iam_token=$(nebius iam get-access-token)).
data "terraform_remote_state" "cluster" {
  backend = "local"
  config = {
    path = var.cluster_state_path
  }
}

provider "kubernetes" {
  host                   = data.terraform_remote_state.cluster.outputs.kube_host
  cluster_ca_certificate = data.terraform_remote_state.cluster.outputs.kube_cluster_ca_certificate
  token                  = var.iam_token
}
