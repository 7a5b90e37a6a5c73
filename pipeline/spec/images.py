"""The `prompt.images` section: where a prompt's images may come from and how large they may
be (batch jobs; Serve has the same settings under `serve.images`)."""

from __future__ import annotations

from pydantic import Field, model_validator

from engines.strict import StrictModel


class ImagesSpec(StrictModel):
    max_images: int = Field(
        8,
        ge=1,
        description="Images one prompt may carry; a row with more is an error row naming the "
        "count (the model's own limit may be lower: its context must hold their tokens).",
    )
    max_image_bytes: int = Field(
        20 * 1024 * 1024,
        ge=1,
        description="Largest encoded image (bytes of the file or data: URL) accepted; larger "
        "is the row's error, found before the whole image is read where the source says its "
        "size.",
    )
    max_pixels: int = Field(
        50_000_000,
        ge=1,
        description="Largest decoded image (width x height) accepted, checked from the header "
        "before decoding (a guard against decompression bombs). The model's processor then "
        "resizes within its own pixel budget.",
    )
    allow_local: bool = Field(
        True,
        description="Whether image URLs may be local paths (or file:// URIs), read on the "
        "worker that renders the prompt. Serve never reads local files.",
    )
    http_hosts: list[str] = Field(
        default_factory=list,
        description="Hosts whose http(s):// image URLs may be fetched (exact names, e.g. "
        "images.example.com). Empty: no remote fetching; data: URLs and s3:// URIs (read with "
        "the job's storage section) are always allowed.",
    )
    http_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Seconds an http(s) image fetch may take before the row fails.",
    )

    @model_validator(mode="after")
    def _hosts_are_names(self) -> ImagesSpec:
        for host in self.http_hosts:
            if not host or "/" in host or ":" in host.strip("[]"):
                raise ValueError(
                    f"prompt.images.http_hosts entry {host!r} must be a bare host name "
                    "(no scheme, port or path)"
                )
        return self
