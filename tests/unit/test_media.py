"""Image parts of a chat, and image sources and limits (pipeline.media, pipeline.openai.chat):
the parts kept in order for the template, each named by where it came from; data: URLs, local
files and what is refused (size, pixels, format, corruption, hosts) with the reason."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import pytest

from pipeline.media.fetch import decode_image, fetch_image
from pipeline.media.process import ImageError
from pipeline.openai.chat import PromptError, chat_images, chat_messages
from pipeline.spec.images import ImagesSpec


def _png(width: int = 20, height: int = 10, fmt: str = "PNG") -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(out, format=fmt)
    return out.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_image_parts_stay_in_order_and_name_their_place() -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "data:1"}},
                {"type": "image_url", "image_url": {"url": "data:2", "detail": "low"}},
            ],
        },
    ]
    chat = chat_messages(messages, system_prompt="rules")
    assert chat[0] == {"role": "system", "content": "rules"}
    assert [p["type"] for p in chat[2]["content"]] == ["text", "image", "image"]
    # Named by the request's own indexes, not shifted by the system prompt put first.
    assert chat_images(chat) == [
        ("data:1", "messages[1].content[1]"),
        ("data:2", "messages[1].content[2]"),
    ]
    assert chat_images(chat_messages([{"role": "user", "content": "x"}])) == []
    # An image alone is content: not "all empty".
    only = chat_messages([{"role": "user", "content": [{"type": "image_url", "image_url": "d:"}]}])
    assert chat_images(only) == [("d:", "messages[0].content[0]")]


def test_sources(tmp_path: Path) -> None:
    limits = ImagesSpec()
    data = _png()
    assert fetch_image(_url(data), limits, None) == data
    path = tmp_path / "a.png"
    path.write_bytes(data)
    assert fetch_image(str(path), limits, None) == data
    assert fetch_image(f"file://{path}", limits, None) == data
    assert fetch_image(data, limits, None) == data  # an image column's bytes
    refusals = {
        "local image paths are not allowed": (str(path), ImagesSpec(allow_local=False)),
        "no such image": (str(tmp_path / "nope.png"), limits),
        "from 'example.com' is not allowed": ("https://example.com/a.png", limits),
        "unsupported image URL scheme 'ftp'": ("ftp://host/a.png", limits),
        "must be base64": ("data:image/png,abc", limits),
        "not valid base64": ("data:image/png;base64,@@", limits),
        "over prompt.images.max_image_bytes (10)": (_url(data), ImagesSpec(max_image_bytes=10)),
        "s3:// images are not read here": ("s3://bucket/a.png", limits),
    }
    for needle, (url, spec) in refusals.items():
        with pytest.raises(ImageError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            fetch_image(url, spec, None)


def test_decoding_limits() -> None:
    image = decode_image(_png(fmt="JPEG"), ImagesSpec())
    assert image.mode == "RGB" and image.size == (20, 10)
    with pytest.raises(ImageError, match=r"20x10 pixels is over prompt.images.max_pixels \(100\)"):
        decode_image(_png(), ImagesSpec(max_pixels=100))
    with pytest.raises(ImageError, match="not an image Pillow can read"):
        decode_image(b"hello", ImagesSpec())
    jpeg = _png(200, 200, "JPEG")
    with pytest.raises(ImageError, match="corrupt or truncated JPEG"):
        decode_image(jpeg[: len(jpeg) // 2], ImagesSpec())
    with pytest.raises(ImageError, match="unsupported image format ICO"):
        decode_image(_png(16, 16, "ICO"), ImagesSpec())


def test_hosts_are_bare_names() -> None:
    with pytest.raises(ValueError, match="bare host name"):
        ImagesSpec(http_hosts=["https://example.com"])
    assert ImagesSpec(http_hosts=["images.example.com"]).http_hosts == ["images.example.com"]


def test_prompt_error_is_raised_for_bad_parts() -> None:
    with pytest.raises(PromptError, match=r"messages\[0\].content\[0\].image_url.url"):
        chat_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
