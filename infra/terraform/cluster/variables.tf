# --- project and access ----------------------------------------------------------------------

variable "parent_id" {
  description = "Nebius project ID (project-...) that owns every resource created here."
  type        = string
}

variable "subnet_id" {
  description = "VPC subnet ID (vpcsubnet-...) for the control plane and the nodes."
  type        = string
}

variable "region" {
  description = "Nebius region, e.g. eu-north1; used for the Object Storage endpoint output."
  type        = string
  default     = "eu-north1"
}

variable "nebius_api_domain" {
  description = "Nebius API endpoint for the provider."
  type        = string
  default     = "api.nebius.cloud:443"
}

variable "iam_token" {
  description = "Short-lived Nebius IAM token for the Helm provider: export TF_VAR_iam_token=$(nebius iam get-access-token). Never commit it."
  type        = string
  sensitive   = true
}

variable "name" {
  description = "Name prefix for the cluster, node groups and bucket."
  type        = string
  default     = "tokenmill"
}

variable "labels" {
  description = "Labels added to every Nebius resource."
  type        = map(string)
  default     = { app = "tokenmill" }
}

# --- Kubernetes ------------------------------------------------------------------------------

variable "k8s_version" {
  description = "Kubernetes minor version of the control plane and the node groups."
  type        = string
  default     = "1.31"
}

variable "public_endpoint" {
  description = "Expose the Kubernetes API on a public address (needed to apply ../workloads from outside the VPC)."
  type        = bool
  default     = true
}

variable "etcd_cluster_size" {
  description = "etcd members of the control plane: 1 for tests, 3 for production."
  type        = number
  default     = 3
}

# --- CPU node group (Ray heads, the nightly CronJob, the KubeRay operator) -------------------

variable "cpu_platform" {
  description = "Compute platform of the CPU nodes, e.g. cpu-d3."
  type        = string
  default     = "cpu-d3"
}

variable "cpu_preset" {
  description = "Preset (vCPU and memory) of the CPU nodes, e.g. 8vcpu-32gb."
  type        = string
  default     = "8vcpu-32gb"
}

variable "cpu_min_nodes" {
  description = "Autoscaling lower bound of the CPU node group (Ray heads live here: keep at least 1)."
  type        = number
  default     = 1
}

variable "cpu_max_nodes" {
  description = "Autoscaling upper bound of the CPU node group."
  type        = number
  default     = 3
}

variable "cpu_disk_gib" {
  description = "Boot disk size of a CPU node, GiB (holds the Ray image)."
  type        = number
  default     = 128
}

# --- GPU node group (Ray GPU workers: batch engines and Serve replicas) ----------------------

variable "gpu_platform" {
  description = "Compute platform of the GPU nodes, e.g. gpu-h200-sxm or gpu-h100-sxm."
  type        = string
  default     = "gpu-h200-sxm"
}

variable "gpu_preset" {
  description = "Preset of the GPU nodes, e.g. 1gpu-16vcpu-200gb or 8gpu-128vcpu-1600gb."
  type        = string
  default     = "1gpu-16vcpu-200gb"
}

variable "gpu_min_nodes" {
  description = "Autoscaling lower bound of the GPU node group; 0 lets it scale to zero between nights."
  type        = number
  default     = 0
}

variable "gpu_max_nodes" {
  description = "Autoscaling upper bound of the GPU node group: caps spend and the Ray autoscaler."
  type        = number
  default     = 4
}

variable "gpu_preemptible" {
  description = "Use preemptible GPU nodes (cheaper, can be reclaimed; a reclaimed night resumes on resubmit)."
  type        = bool
  default     = false
}

variable "gpu_drivers_preset" {
  description = "NVIDIA driver preset installed on GPU nodes (gpu_settings.drivers_preset), e.g. cuda12.8 or cuda13.0."
  type        = string
  default     = "cuda12.8"
}

variable "gpu_disk_gib" {
  description = "Boot disk size of a GPU node, GiB (Ray image, model cache, TensorRT-LLM engines)."
  type        = number
  default     = 512
}

# --- storage and operator --------------------------------------------------------------------

variable "bucket_name" {
  description = "Object Storage bucket for inputs, outputs and model artifacts; globally unique. Empty: <name>-<parent_id suffix>."
  type        = string
  default     = ""
}

variable "abort_incomplete_multipart_days" {
  description = "Days after which unfinished multipart uploads (e.g. a writer killed mid-part) are aborted and stop costing storage."
  type        = number
  default     = 3
}

variable "kuberay_chart_version" {
  description = "Version of the kuberay-operator Helm chart; >= 1.6 for authOptions.secretName (Ray token auth with a shared secret)."
  type        = string
  default     = "1.6.2"
}

variable "kuberay_namespace" {
  description = "Namespace of the KubeRay operator."
  type        = string
  default     = "kuberay-system"
}
