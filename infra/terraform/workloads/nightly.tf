# The nightly schedule: a plain Kubernetes CronJob whose pod runs `tokenmill submit ... --wait`
# against the batch cluster's Jobs API. Why not KubeRay's RayCronJob: it is alpha (feature gate
# RayCronJob, KubeRay 1.6) and has no concurrency policy. Here double runs are prevented twice:
#   - concurrencyPolicy Forbid: no second submitter pod while one is still waiting;
#   - the submission id is derived from job name + date + spec hash, so even a second submitter
#     (a retry pod, a person by hand) attaches to the running night instead of starting one.
# A failed pod is retried by the Job (backoff_limit); the retry resubmits as <id>-rN, which
# resumes from the committed parts. A night whose slot was missed is caught up by hand:
#   tokenmill submit jobs/nightly.yaml --address <dashboard> --date YYYY-MM-DD --wait

resource "kubernetes_service_account_v1" "nightly" {
  metadata {
    name      = "tokenmill-nightly"
    namespace = kubernetes_namespace_v1.tokenmill.metadata[0].name
  }
  # The submitter talks only to the Ray Jobs API, never to the Kubernetes API.
  automount_service_account_token = false
}

resource "kubernetes_cron_job_v1" "nightly" {
  count = var.nightly_enabled ? 1 : 0

  metadata {
    name      = "tokenmill-nightly"
    namespace = kubernetes_namespace_v1.tokenmill.metadata[0].name
  }

  spec {
    schedule                      = var.nightly_schedule
    timezone                      = var.nightly_time_zone
    concurrency_policy            = "Forbid"
    starting_deadline_seconds     = var.nightly_starting_deadline_seconds
    successful_jobs_history_limit = 3
    failed_jobs_history_limit     = 7

    job_template {
      metadata {
        labels = { "app.kubernetes.io/name" = "tokenmill-nightly" }
      }
      spec {
        backoff_limit           = var.nightly_retries
        active_deadline_seconds = var.nightly_deadline_seconds

        template {
          metadata {
            labels = { "app.kubernetes.io/name" = "tokenmill-nightly" }
          }
          spec {
            restart_policy                  = "Never"
            service_account_name            = kubernetes_service_account_v1.nightly.metadata[0].name
            automount_service_account_token = false
            node_selector                   = { "tokenmill.io/pool" = "cpu" }

            security_context {
              run_as_non_root = true
              run_as_user     = 1000
              run_as_group    = 1000
              seccomp_profile {
                type = "RuntimeDefault"
              }
            }

            container {
              name              = "submit"
              image             = local.submitter_image
              image_pull_policy = "Always"
              command           = ["/bin/sh", "-c", local.nightly_command]

              env {
                name  = "RAY_AUTH_MODE"
                value = "token"
              }
              env {
                name = "RAY_AUTH_TOKEN"
                value_from {
                  secret_key_ref {
                    name = var.ray_auth_secret
                    key  = "auth_token"
                  }
                }
              }

              resources {
                requests = { cpu = "250m", memory = "512Mi" }
                limits   = { cpu = "500m", memory = "512Mi" }
              }

              security_context {
                allow_privilege_escalation = false
                read_only_root_filesystem  = true
                run_as_non_root            = true
                capabilities {
                  drop = ["ALL"]
                }
              }

              volume_mount {
                name       = "jobs"
                mount_path = local.config_dir
                read_only  = true
              }
              # `tokenmill submit` stages the job file in a temporary directory.
              volume_mount {
                name       = "tmp"
                mount_path = "/tmp"
              }
            }

            volume {
              name = "jobs"
              config_map {
                name = kubernetes_config_map_v1.jobs.metadata[0].name
              }
            }
            volume {
              name = "tmp"
              empty_dir {
                size_limit = "64Mi"
              }
            }
          }
        }
      }
    }
  }
}
