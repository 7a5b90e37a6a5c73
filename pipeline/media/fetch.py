"""An image URL into a decoded image, within the configured sources and limits.

Sources: `data:` URLs (base64) always; `s3://` URIs through the job's storage section (the
S3-compatible endpoint and credentials every other object uses); local paths and `file://`
URIs where `allow_local` (batch jobs; never Serve); `http(s)://` only to the listed hosts, with
a time limit. Every source is read at most `max_image_bytes` + 1 bytes, so an oversized image
is refused without holding it. Decoding (Pillow) reads the header first and refuses images
over `max_pixels` before their pixels are decoded; a corrupt or truncated file fails in
`load()`, here, not later in the model's processor.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
import urllib.request
from typing import Any

from pipeline.media.process import ImageError
from pipeline.spec import StorageSpec
from pipeline.spec.images import ImagesSpec
from pipeline.storage.files import filesystem_for, is_s3, strip_file_scheme

# Formats Pillow decodes that models are fed in practice; anything else is refused by name.
FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")


def fetch_image(url: str | bytes, limits: ImagesSpec, storage: StorageSpec | None) -> bytes:
    """The encoded bytes behind `url` (bytes: an image column's cell, as they are); ImageError
    says why not (what to change)."""
    if isinstance(url, (bytes, bytearray, memoryview)):
        data = bytes(url)
        if len(data) > limits.max_image_bytes:
            raise _too_large(len(data), limits)
        return data
    if not isinstance(url, str) or not url:
        raise ImageError("the image URL is empty")
    if url.startswith("data:"):
        return _data_url(url, limits)
    if is_s3(url):
        if storage is None:
            raise ImageError(f"{url}: s3:// images are not read here; send a data: URL")
        return _read_file(url, limits, storage)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        return _http(url, limits)
    if scheme in ("", "file"):
        if not limits.allow_local:
            raise ImageError(
                f"{url}: local image paths are not allowed here; send a data: URL or an s3:// URI"
            )
        return _read_file(strip_file_scheme(url), limits, StorageSpec())
    raise ImageError(
        f"{url[:60]}: unsupported image URL scheme {scheme!r}; use data:, s3://, a local path "
        "or an http(s) URL from prompt.images.http_hosts"
    )


def decode_image(data: bytes, limits: ImagesSpec) -> Any:
    """`data` decoded to an RGB PIL image; ImageError for an unsupported format, a corrupt or
    truncated file, or more pixels than allowed."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageError(
            f"not an image Pillow can read ({len(data)} bytes; supported: {', '.join(FORMATS)})"
        ) from None
    if image.format not in FORMATS:
        raise ImageError(f"unsupported image format {image.format}; use {', '.join(FORMATS)}")
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageError(
            f"image of {width}x{height} pixels is over prompt.images.max_pixels "
            f"({limits.max_pixels})"
        )
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as exc:  # Pillow's truncated / corrupt errors
        raise ImageError(f"corrupt or truncated {image.format} image ({exc})") from None
    return image.convert("RGB")


def _too_large(size: int, limits: ImagesSpec) -> ImageError:
    return ImageError(
        f"image of {size} bytes or more is over prompt.images.max_image_bytes "
        f"({limits.max_image_bytes})"
    )


def _data_url(url: str, limits: ImagesSpec) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ImageError("a data: image URL must be base64: data:image/png;base64,<data>")
    if len(payload) * 3 // 4 > limits.max_image_bytes + 3:
        raise _too_large(len(payload) * 3 // 4, limits)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"the data: URL is not valid base64 ({exc})") from None
    if len(data) > limits.max_image_bytes:
        raise _too_large(len(data), limits)
    return data


def _read_file(uri: str, limits: ImagesSpec, storage: StorageSpec) -> bytes:
    fs, path = filesystem_for(uri, storage)
    try:
        with fs.open(path, "rb") as handle:
            data = handle.read(limits.max_image_bytes + 1)
    except FileNotFoundError:
        raise ImageError(f"{uri}: no such image") from None
    except (OSError, PermissionError) as exc:
        raise ImageError(f"{uri}: cannot read the image ({type(exc).__name__}: {exc})") from None
    if len(data) > limits.max_image_bytes:
        raise _too_large(len(data), limits)
    return data


def _http(url: str, limits: ImagesSpec) -> bytes:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host not in limits.http_hosts:
        raise ImageError(
            f"{url[:80]}: fetching images from {host!r} is not allowed; list the host in "
            "prompt.images.http_hosts, or send a data: URL or an s3:// URI"
        )
    try:
        with urllib.request.urlopen(url, timeout=limits.http_timeout_s) as response:
            declared = response.headers.get("Content-Length")
            if declared and declared.isdigit() and int(declared) > limits.max_image_bytes:
                raise _too_large(int(declared), limits)
            data = response.read(limits.max_image_bytes + 1)
    except ImageError:
        raise
    except Exception as exc:  # URLError, HTTPError, timeouts: the row's error, named
        raise ImageError(f"{url[:80]}: fetch failed ({type(exc).__name__}: {exc})") from None
    if len(data) > limits.max_image_bytes:
        raise _too_large(len(data), limits)
    return data
