"""`tokenmill doctor`: what this environment can run, and what stands in the way.

Each module checks one thing and returns Findings; `run_checks` gathers them in a fixed order.
Nothing here changes the environment, and no credential value is ever read into a finding.
"""

from __future__ import annotations

from pipeline.doctor.findings import Finding, Status


def run_checks(
    probe_engines: bool = True, ray_timeout_s: float = 5.0, env: dict[str, str] | None = None
) -> list[Finding]:
    """Every check, in report order. `probe_engines`: import each installed engine in a
    subprocess (seconds to a minute on a GPU image); `env` defaults to os.environ."""
    import os

    # lazy: the checks import what they check; the package itself stays cheap to import
    from pipeline.doctor import device, engines, environment, packages

    env = dict(os.environ) if env is None else env
    findings = packages.check_ranges()
    findings += packages.check_extras()
    findings += engines.check_engines(probe=probe_engines)
    findings += device.check_device()
    findings += environment.check_storage(env)
    findings += environment.check_ray(env, ray_timeout_s)
    return findings


__all__ = ["Finding", "Status", "run_checks"]
