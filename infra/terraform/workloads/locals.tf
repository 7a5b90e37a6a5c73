locals {
  repo_root         = "${path.module}/../../.."
  nightly_job_file  = var.nightly_job_file != "" ? var.nightly_job_file : "${local.repo_root}/jobs/nightly.yaml"
  serve_config_file = var.serve_config_file != "" ? var.serve_config_file : "${local.repo_root}/jobs/${local.serve_engine_file[var.serve_engine]}"
  # The Serve file of each serve_engine, under jobs/.
  serve_engine_file = {
    vllm   = "serve-gpu.yaml"
    trtllm = "serve-gpu-trtllm.yaml"
  }
  submitter_image = var.submitter_image != "" ? var.submitter_image : var.batch_head_image

  # Where the ConfigMap with the job and serve files is mounted in every pod.
  config_dir        = "/etc/tokenmill/jobs"
  nightly_job_path  = "${local.config_dir}/nightly.yaml"
  serve_config_path = "${local.config_dir}/serve.yaml"

  # The keys file (var.serve_keys_file_secret): a secret volume mounted as a whole directory,
  # never through subPath, since a subPath mount is not updated when the secret changes and
  # the ingress replicas reload the file on change (pipeline/serve/access/keys.py).
  serve_keys_dir       = "/etc/tokenmill/serve-keys"
  serve_keys_file_path = "${local.serve_keys_dir}/keys.yaml"

  # The serve YAML as mounted: the file as written, or, with a keys-file secret, the same
  # settings with auth.keys_file pointing at the mounted file (merge skips a null `auth`).
  serve_config_text = file(local.serve_config_file)
  serve_config_yaml = var.serve_keys_file_secret == null ? local.serve_config_text : yamlencode(merge(
    yamldecode(local.serve_config_text),
    { auth = merge(try(yamldecode(local.serve_config_text).auth, null), { keys_file = local.serve_keys_file_path }) },
  ))

  batch_cluster_name = "tokenmill-batch"
  serve_name         = "tokenmill-serve"
  # KubeRay names the head Service <cluster>-head-svc; 8265 is the dashboard / Jobs API.
  dashboard_url = "http://${local.batch_cluster_name}-head-svc.${var.namespace}.svc.cluster.local:8265"
  serve_url     = "http://${local.serve_name}-serve-svc.${var.namespace}.svc.cluster.local:8000"

  # The nightly command. Same template as pipeline.submit.NIGHTLY_SUBMIT_TEMPLATE with the date
  # computed when the pod starts; tests/unit/test_terraform.py checks the two agree.
  nightly_command = "tokenmill submit ${local.nightly_job_path} --address ${local.dashboard_url} --date \"$(date -u +%F)\" --wait"

  # --- pieces shared by the Ray pods of both clusters ----------------------------------------

  s3_env = [
    { name = "AWS_ACCESS_KEY_ID", valueFrom = { secretKeyRef = { name = var.s3_credentials_secret, key = "AWS_ACCESS_KEY_ID" } } },
    { name = "AWS_SECRET_ACCESS_KEY", valueFrom = { secretKeyRef = { name = var.s3_credentials_secret, key = "AWS_SECRET_ACCESS_KEY" } } },
    { name = "AWS_ENDPOINT_URL", value = var.s3_endpoint_url },
  ]

  container_security_context = {
    runAsNonRoot             = true
    allowPrivilegeEscalation = false
    capabilities             = { drop = ["ALL"] }
    seccompProfile           = { type = "RuntimeDefault" }
  }

  config_volume = { name = "jobs", configMap = { name = kubernetes_config_map_v1.jobs.metadata[0].name } }
  config_mount  = { name = "jobs", mountPath = local.config_dir, readOnly = true }

  # Ray needs /dev/shm larger than the container default for its object store.
  shm_volume = { name = "dshm", emptyDir = { medium = "Memory" } }
  shm_mount  = { name = "dshm", mountPath = "/dev/shm" }

  head_group = {
    rayStartParams = { "dashboard-host" = "0.0.0.0", "num-cpus" = "0" }
    template = {
      spec = {
        nodeSelector = { "tokenmill.io/pool" = "cpu" }
        containers = [{
          name            = "ray-head"
          image           = var.batch_head_image
          imagePullPolicy = "IfNotPresent"
          env             = local.s3_env
          ports = [
            { name = "gcs", containerPort = 6379 },
            { name = "dashboard", containerPort = 8265 },
            { name = "client", containerPort = 10001 },
            { name = "serve", containerPort = 8000 },
          ]
          resources = {
            requests = { cpu = var.head_cpu, memory = var.head_memory }
            limits   = { cpu = var.head_cpu, memory = var.head_memory }
          }
          securityContext = local.container_security_context
          volumeMounts    = [local.config_mount, local.shm_mount]
        }]
        volumes = [local.config_volume, local.shm_volume]
      }
    }
  }

  gpu_worker_template = {
    spec = {
      nodeSelector = { "tokenmill.io/pool" = "gpu" }
      tolerations  = [{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }]
      containers = [{
        name            = "ray-worker"
        image           = var.batch_gpu_image
        imagePullPolicy = "IfNotPresent"
        env             = local.s3_env
        resources = {
          requests = { cpu = var.worker_cpu, memory = var.worker_memory, "nvidia.com/gpu" = var.gpus_per_worker }
          limits   = { cpu = var.worker_cpu, memory = var.worker_memory, "nvidia.com/gpu" = var.gpus_per_worker }
        }
        securityContext = local.container_security_context
        volumeMounts    = [local.config_mount, local.shm_mount]
      }]
      volumes = [local.config_volume, local.shm_volume]
    }
  }

  autoscaler_options = {
    idleTimeoutSeconds = var.autoscaler_idle_timeout_seconds
    upscalingMode      = "Default"
    image              = var.batch_head_image
    imagePullPolicy    = "IfNotPresent"
    securityContext    = local.container_security_context
    resources = {
      requests = { cpu = "500m", memory = "512Mi" }
      limits   = { cpu = "500m", memory = "512Mi" }
    }
  }

  # KubeRay >= 1.6 sets RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (from this secret) on every
  # Ray container, and uses the token itself when it talks to the dashboard.
  auth_options = { mode = "token", secretName = var.ray_auth_secret }
}
