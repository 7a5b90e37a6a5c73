# --- access ----------------------------------------------------------------------------------

variable "cluster_state_path" {
  description = "Path of ../cluster's Terraform state (local backend); point it at a copy if you use a remote backend there."
  type        = string
  default     = "../cluster/terraform.tfstate"
}

variable "iam_token" {
  description = "Short-lived Nebius IAM token for the Kubernetes provider: export TF_VAR_iam_token=$(nebius iam get-access-token). Never commit it."
  type        = string
  sensitive   = true
}

variable "namespace" {
  description = "Namespace for the Ray clusters, the nightly CronJob and their ConfigMap."
  type        = string
  default     = "tokenmill"
}

variable "kuberay_namespace" {
  description = "Namespace of the KubeRay operator (allowed through the network policy to reach Ray dashboards)."
  type        = string
  default     = "kuberay-system"
}

# --- images ----------------------------------------------------------------------------------

variable "batch_head_image" {
  description = "Image of the batch cluster's head and autoscaler (the job drivers run here): images/cpu.Dockerfile built beside the GPU image (default PINS=trtllm-1.2). Same Python and Ray as batch_gpu_image. Pin a tag or digest."
  type        = string
}

variable "batch_gpu_image" {
  description = "Image of the batch cluster's GPU workers (engine and prompt actors): images/trtllm.Dockerfile for engine.kind trtllm (jobs/nightly.yaml), images/vllm.Dockerfile for vllm. Pin a tag or digest."
  type        = string
}

variable "serve_head_image" {
  description = "Image of the Serve cluster's head and autoscaler (Serve controller, HTTP ingress): images/cpu.Dockerfile with PINS=vllm-0.32-cuda, TORCH=2.13.0, EXTRAS=serve for serve_engine \"vllm\"; with OVERRIDE=trtllm-1.2-serve, EXTRAS=serve for \"trtllm\". Pin a tag or digest."
  type        = string
}

variable "serve_gpu_image" {
  description = "Image of the Serve cluster's GPU workers (engine replicas): images/vllm.Dockerfile for serve_engine \"vllm\" (jobs/serve-gpu.yaml), images/trtllm.Dockerfile (the batch GPU image itself) for \"trtllm\" (jobs/serve-gpu-trtllm.yaml). Pin a tag or digest."
  type        = string
}

variable "submitter_image" {
  description = "Image of the nightly CronJob pod (needs only tokenmill and Ray's job client). Empty: batch_head_image."
  type        = string
  default     = ""
}

variable "ray_version" {
  description = "Ray version in the image (KubeRay needs >= 2.52 for token auth)."
  type        = string
  default     = "2.60.0"
}

# --- secrets (created out of band with kubectl; referenced by name only) ---------------------

variable "ray_auth_secret" {
  description = "Secret with key auth_token: the Ray cluster token (KubeRay authOptions.secretName) that `tokenmill submit` also sends."
  type        = string
  default     = "tokenmill-ray-auth"
}

variable "s3_credentials_secret" {
  description = "Secret with keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY: an Object Storage access key of a service account."
  type        = string
  default     = "tokenmill-s3"
}

variable "serve_api_keys_secret" {
  description = "Secret with key api_keys: comma-separated bearer keys accepted by the Serve endpoint (TOKENMILL_API_KEYS)."
  type        = string
  default     = "tokenmill-serve-keys"
}

variable "serve_keys_file_secret" {
  description = "Secret holding the Serve keys file (named keys by SHA-256 digest, with per-key limits and allowed models; docs/serve.md) under key keys.yaml. When set, it is mounted read-only into every Serve pod at /etc/tokenmill/serve-keys and the serve YAML's auth.keys_file points at it; an update of the secret reaches the running replicas without a restart. null: no keys file."
  type        = string
  default     = null
}

variable "s3_endpoint_url" {
  description = "S3 endpoint of the bucket (../cluster output s3_endpoint_url), exported as AWS_ENDPOINT_URL in Ray pods."
  type        = string
  default     = "https://storage.eu-north1.nebius.cloud"
}

# --- Ray clusters ----------------------------------------------------------------------------

variable "head_cpu" {
  description = "CPU request/limit of a Ray head pod (runs the job driver and the dashboard, no engines)."
  type        = string
  default     = "2"
}

variable "head_memory" {
  description = "Memory request/limit of a Ray head pod."
  type        = string
  default     = "8Gi"
}

variable "gpus_per_worker" {
  description = "GPUs per Ray worker pod (match the GPU node preset, e.g. 1 for 1gpu-16vcpu-200gb)."
  type        = number
  default     = 1
}

variable "worker_cpu" {
  description = "CPU request/limit of a Ray GPU worker pod (leave room for node daemons)."
  type        = string
  default     = "14"
}

variable "worker_memory" {
  description = "Memory request/limit of a Ray GPU worker pod."
  type        = string
  default     = "180Gi"
}

variable "batch_min_workers" {
  description = "Fewest GPU workers of the batch RayCluster; 0 lets the Ray autoscaler release every GPU between nights."
  type        = number
  default     = 0
}

variable "batch_max_workers" {
  description = "Most GPU workers of the batch RayCluster (also bounded by the GPU node group's max)."
  type        = number
  default     = 4
}

variable "autoscaler_idle_timeout_seconds" {
  description = "Seconds a Ray worker stays idle before the autoscaler removes it."
  type        = number
  default     = 300
}

# --- Serve -----------------------------------------------------------------------------------

variable "serve_enabled" {
  description = "Deploy the long-running Serve RayService (OpenAI-compatible endpoint)."
  type        = bool
  default     = true
}

variable "serve_engine" {
  description = "Engine of the Serve cluster's GPU replicas. \"vllm\": vLLM's image, Serve in its own environment. \"trtllm\": TensorRT-LLM's image (the nightly's, serving its FP8 checkpoint): Ray's processes on the Serve pods run under the image's Serve environment (/opt/serve-env, first on PATH), each replica's engine process under the container's Python (replicas.engine_python); docs/deploy.md. Picks the default serve_config_file; set serve_head_image and serve_gpu_image to the matching builds."
  type        = string
  default     = "vllm"
  validation {
    condition     = contains(["vllm", "trtllm"], var.serve_engine)
    error_message = "serve_engine must be \"vllm\" or \"trtllm\"."
  }
}

variable "serve_config_file" {
  description = "Serve YAML turned into the RayService's config. Empty: this repository's file for serve_engine, jobs/serve-gpu.yaml (vLLM) or jobs/serve-gpu-trtllm.yaml (TensorRT-LLM)."
  type        = string
  default     = ""
}

variable "serve_min_workers" {
  description = "Fewest GPU workers of the Serve cluster (1 keeps the endpoint warm)."
  type        = number
  default     = 1
}

variable "serve_max_workers" {
  description = "Most GPU workers of the Serve cluster."
  type        = number
  default     = 2
}

# --- nightly schedule ------------------------------------------------------------------------

variable "nightly_enabled" {
  description = "Create the nightly CronJob."
  type        = bool
  default     = true
}

variable "nightly_job_file" {
  description = "Job YAML run every night. Empty: jobs/nightly.yaml of this repository."
  type        = string
  default     = ""
}

variable "nightly_schedule" {
  description = "Cron schedule of the nightly submission, in nightly_time_zone."
  type        = string
  default     = "0 1 * * *"
}

variable "nightly_time_zone" {
  description = "IANA time zone of nightly_schedule. The run date passed to the job is always the UTC date at start."
  type        = string
  default     = "Etc/UTC"
}

variable "nightly_starting_deadline_seconds" {
  description = "A run that cannot start within this many seconds of its slot is skipped (and must be caught up with --date); bounds how late a night may start."
  type        = number
  default     = 3600
}

variable "nightly_retries" {
  description = "Kubernetes Job retries of a failed nightly pod; each retry resubmits, which resumes the failed attempt as <id>-rN."
  type        = number
  default     = 2
}

variable "nightly_deadline_seconds" {
  description = "Wall-clock limit of one night's Kubernetes Job (all retries), after which the submitter is stopped."
  type        = number
  default     = 72000
}
