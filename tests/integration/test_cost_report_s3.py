"""The run report on S3 (moto over real HTTP): read parts and manifest from a bucket, write
report.md and the plots back beside them, and `tokenmill report s3://...` with an endpoint."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.report import write_report
from tests.integration.s3_server import S3Server


def _upload_output(local: Path, s3_server: S3Server, prefix: str) -> None:
    for path in sorted(local.iterdir()):
        if path.is_file():
            s3_server.put(f"{prefix}/{path.name}", path.read_bytes())


def test_report_reads_and_writes_s3(s3_server: S3Server, bucket: str, tmp_path: Path):
    from tests.unit.test_report import make_output_dir

    local = make_output_dir(tmp_path / "local")
    prefix = f"s3://{bucket}/jobs/unit-report"
    _upload_output(local, s3_server, prefix)

    result = write_report(prefix, s3_server.storage_spec())
    assert result.summary.rows == 12
    text = s3_server.get(f"{prefix}/report.md").decode()
    assert "Books per actor" in text
    for name in result.plot_names:
        assert s3_server.get(f"{prefix}/{name}").startswith(b"\x89PNG")

    storage = s3_server.storage_spec()
    cli = CliRunner().invoke(
        app, ["report", prefix, "--endpoint-url", storage.endpoint_url, "--no-write"]
    )
    assert cli.exit_code == 0, cli.output
    assert "USD per 1M output tokens" in cli.output
    missing = CliRunner().invoke(
        app, ["report", f"s3://{bucket}/nothing", "--endpoint-url", storage.endpoint_url]
    )
    assert missing.exit_code == 2 and "_manifest.json" in missing.output
