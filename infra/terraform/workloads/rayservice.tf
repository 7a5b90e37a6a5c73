# The long-running OpenAI-compatible endpoint: Ray Serve runs tokenmill's Serve application
# (what `tokenmill serve SERVE.yaml` runs locally) from the serve YAML mounted at
# local.serve_config_path. Editing jobs/serve.yaml and applying rolls the app in place.
# /ready and /health are two small applications of their own (pipeline/serve/http/probes.py), so
# they answer while the main app's only replica is replaced; `app` names the app /ready watches.
locals {
  serve_app_name = "tokenmill"
  serve_config_v2 = yamlencode({
    http_options = { host = "0.0.0.0", port = 8000 }
    applications = [
      {
        name         = local.serve_app_name
        import_path  = "pipeline.serve.app:app_builder"
        route_prefix = "/"
        args         = { config = local.serve_config_path }
      },
      {
        name         = "${local.serve_app_name}-ready"
        import_path  = "pipeline.serve.http.probes:ready_app_builder"
        route_prefix = "/ready"
        args         = { config = local.serve_config_path, app = local.serve_app_name }
      },
      {
        name         = "${local.serve_app_name}-health"
        import_path  = "pipeline.serve.http.probes:health_app_builder"
        route_prefix = "/health"
      },
    ]
  })

  # Serve pods additionally get the accepted API keys from their secret and, with
  # var.serve_keys_file_secret, the keys file mounted read-only where the serve YAML's
  # auth.keys_file points (local.serve_config_yaml). Head and workers alike: ingress replicas
  # and the app builder (which checks the file) may run on any of them.
  serve_keys_env = {
    name      = "TOKENMILL_API_KEYS"
    valueFrom = { secretKeyRef = { name = var.serve_api_keys_secret, key = "api_keys" } }
  }
  serve_keys_file_volumes = var.serve_keys_file_secret == null ? [] : [{
    name = "serve-keys-file"
    secret = {
      secretName  = var.serve_keys_file_secret
      items       = [{ key = "keys.yaml", path = "keys.yaml" }]
      defaultMode = 292 # 0444: digests only, but nobody in the pod needs to write it
    }
  }]
  serve_keys_file_mounts = var.serve_keys_file_secret == null ? [] : [{
    name      = "serve-keys-file"
    mountPath = local.serve_keys_dir
    readOnly  = true
  }]
  # serve_engine "trtllm": Ray on the Serve pods starts under the image's Serve environment
  # (images/trtllm.Dockerfile's /opt/serve-env, whose `ray` runs its own interpreter, and Ray
  # runs its workers under the interpreter that started it), never the container's Python,
  # whose fastapi is older than Serve's floor. KubeRay then runs our command instead of its
  # own and hands us its `ray start` line (KUBERAY_GEN_RAY_START_CMD); the ulimit is the one it
  # would have set. The head's image has no /opt/serve-env: the PATH entry is inert there.
  serve_annotations = var.serve_engine == "trtllm" ? { "ray.io/overwrite-container-cmd" = "true" } : {}
  serve_container_cmd = var.serve_engine == "trtllm" ? {
    command = ["/bin/bash", "-lc", "--"]
    args    = ["ulimit -n 65536; export PATH=/opt/serve-env/bin:$PATH; $KUBERAY_GEN_RAY_START_CMD"]
  } : {}
  serve_head_group = merge(local.head_group, {
    template = { spec = merge(local.head_group.template.spec, {
      containers = [for c in local.head_group.template.spec.containers : merge(c, local.serve_container_cmd, {
        image        = var.serve_head_image
        env          = concat(c.env, [local.serve_keys_env])
        volumeMounts = concat(c.volumeMounts, local.serve_keys_file_mounts)
      })]
      volumes = concat(local.head_group.template.spec.volumes, local.serve_keys_file_volumes)
    }) }
  })
  serve_worker_template = { spec = merge(local.gpu_worker_template.spec, {
    containers = [for c in local.gpu_worker_template.spec.containers : merge(c, local.serve_container_cmd, {
      image        = var.serve_gpu_image
      env          = concat(c.env, [local.serve_keys_env])
      volumeMounts = concat(c.volumeMounts, local.serve_keys_file_mounts)
    })]
    volumes = concat(local.gpu_worker_template.spec.volumes, local.serve_keys_file_volumes)
  }) }
}

resource "kubernetes_manifest" "serve" {
  count = var.serve_enabled ? 1 : 0

  manifest = {
    apiVersion = "ray.io/v1"
    kind       = "RayService"
    metadata = {
      name      = local.serve_name
      namespace = kubernetes_namespace_v1.tokenmill.metadata[0].name
      # Copied by KubeRay onto the RayCluster it makes for this service.
      annotations = local.serve_annotations
    }
    spec = {
      serveConfigV2 = local.serve_config_v2
      rayClusterConfig = {
        rayVersion              = var.ray_version
        authOptions             = local.auth_options
        enableInTreeAutoscaling = true
        autoscalerOptions       = merge(local.autoscaler_options, { image = var.serve_head_image })
        headGroupSpec           = local.serve_head_group
        workerGroupSpecs = [{
          groupName      = "gpu"
          replicas       = var.serve_min_workers
          minReplicas    = var.serve_min_workers
          maxReplicas    = var.serve_max_workers
          rayStartParams = {}
          template       = local.serve_worker_template
        }]
      }
    }
  }
}
