resource "nebius_mk8s_v1_cluster" "this" {
  parent_id = var.parent_id
  name      = var.name
  labels    = var.labels

  control_plane = {
    subnet_id         = var.subnet_id
    version           = var.k8s_version
    etcd_cluster_size = var.etcd_cluster_size
    endpoints = {
      public_endpoint = var.public_endpoint ? {} : null
    }
  }
}

# CPU nodes: Ray head pods, the nightly CronJob, the KubeRay operator. Small and always on.
resource "nebius_mk8s_v1_node_group" "cpu" {
  parent_id = nebius_mk8s_v1_cluster.this.id
  name      = "${var.name}-cpu"
  labels    = var.labels
  version   = var.k8s_version

  autoscaling = {
    min_node_count = var.cpu_min_nodes
    max_node_count = var.cpu_max_nodes
  }

  template = {
    metadata = {
      labels = { "tokenmill.io/pool" = "cpu" }
    }
    resources = {
      platform = var.cpu_platform
      preset   = var.cpu_preset
    }
    boot_disk = {
      type           = "NETWORK_SSD"
      size_gibibytes = var.cpu_disk_gib
    }
    network_interfaces = [{ subnet_id = var.subnet_id }]
  }
}

# GPU nodes: Ray GPU workers. Scales with the Ray autoscaler's pending pods, to zero when idle.
resource "nebius_mk8s_v1_node_group" "gpu" {
  parent_id = nebius_mk8s_v1_cluster.this.id
  name      = "${var.name}-gpu"
  labels    = var.labels
  version   = var.k8s_version

  autoscaling = {
    min_node_count = var.gpu_min_nodes
    max_node_count = var.gpu_max_nodes
  }

  template = {
    metadata = {
      labels = { "tokenmill.io/pool" = "gpu" }
    }
    # Only pods that tolerate this taint (the Ray GPU workers) land on the expensive nodes.
    taints = [{
      key    = "nvidia.com/gpu"
      value  = "present"
      effect = "NO_SCHEDULE"
    }]
    resources = {
      platform = var.gpu_platform
      preset   = var.gpu_preset
    }
    gpu_settings = {
      drivers_preset = var.gpu_drivers_preset
    }
    # `{}` enables preemptible nodes in this provider; null leaves them on-demand.
    preemptible = var.gpu_preemptible ? {} : null
    boot_disk = {
      type           = "NETWORK_SSD"
      size_gibibytes = var.gpu_disk_gib
    }
    network_interfaces = [{ subnet_id = var.subnet_id }]
  }
}
