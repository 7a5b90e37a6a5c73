"""Images through Serve with the official client, on the shared server's `vision` model (the
reference engine on the tiny Qwen2.5-VL): a data: URL part answers what transformers' greedy
decoding answers for the same image, whole and streamed, beside a text-only request; bad images,
too many images, a remote URL and an image to a text model are 400s naming the part. The
Responses API's input_image parts answer as the chat's image_url parts do."""

from __future__ import annotations

import base64
import io
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from tests.e2e.serve_fixtures import API_KEY, ServerProcess
from tests.vision_fixtures import hf_vision_greedy, random_images, vision_requests

pytestmark = pytest.mark.timeout(300)

TEXT = {"type": "text", "text": "describe what you see in a few words"}
MAX_TOKENS = 8


def _images() -> list:
    """Blocky images: their PNGs fit the shared server's 64 KiB request bodies."""
    return random_images(block=10)


def _data_url(image, fmt: str = "PNG") -> str:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(out.getvalue()).decode()


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected(vision_model_dir: Path) -> list[str]:
    """transformers' greedy answers (text) to an image-less prompt, image 0 and images 1 + 2."""
    cases = [
        ([TEXT], []),
        ([{"type": "image"}, TEXT], [0]),
        ([{"type": "image"}] * 2 + [TEXT], [1, 2]),
    ]
    requests, _ = vision_requests(vision_model_dir, cases, max_tokens=MAX_TOKENS, images=_images())
    tokenizer = AutoTokenizer.from_pretrained(vision_model_dir)
    return [
        tokenizer.decode(ids, skip_special_tokens=True)
        for ids in hf_vision_greedy(vision_model_dir, requests)
    ]


def _chat(client: openai.OpenAI, content, **extra):
    return client.chat.completions.create(
        model="vision",
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
        **extra,
    )


def test_images_answer_as_transformers(client: openai.OpenAI, expected: list[str]) -> None:
    images = _images()
    text_only = _chat(client, [TEXT])
    one = _chat(client, [_image(_data_url(images[0])), TEXT])
    two = _chat(client, [_image(_data_url(images[1])), _image(_data_url(images[2])), TEXT])
    assert [r.choices[0].message.content for r in (text_only, one, two)] == expected
    # Image tokens are prompt tokens: 6 for image 0, 12 + 35 for images 1 and 2.
    assert one.usage.prompt_tokens == text_only.usage.prompt_tokens + 6 + 2
    assert two.usage.prompt_tokens == text_only.usage.prompt_tokens + 47 + 4
    # Streamed: the same answer in deltas.
    stream = _chat(client, [_image(_data_url(images[0])), TEXT], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected[1]


def test_bad_images_are_400s_naming_the_part(client: openai.OpenAI) -> None:
    images = _images()
    good = _image(_data_url(images[0]))
    corrupt = _image(
        "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n" + b"0" * 40).decode()
    )
    cases = {
        "messages[0].content[1]": [good, corrupt, TEXT],
        "at most 2": [good, good, good, TEXT],
        "http_hosts": [_image("https://example.com/cat.png"), TEXT],
        "local image paths": [_image("/etc/hostname"), TEXT],
        "not valid base64": [_image("data:image/png;base64,@@@"), TEXT],
    }
    for needle, content in cases.items():
        with pytest.raises(openai.BadRequestError) as err:
            _chat(client, content)
        assert needle in str(err.value), (needle, str(err.value))
        assert err.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": [good, TEXT]}],
            max_tokens=2,
        )
    assert "text-only model" in str(err.value)


def test_the_responses_api_takes_input_image_parts(
    client: openai.OpenAI, expected: list[str]
) -> None:
    image = _images()[0]
    content = [
        {"type": "input_image", "image_url": _data_url(image)},
        {"type": "input_text", "text": TEXT["text"]},
    ]
    response = client.responses.create(
        model="vision",
        input=[{"role": "user", "content": content}],
        max_output_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert response.output_text == expected[1]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model="vision",
            input=[
                {
                    "role": "user",
                    "content": [{**content[0], "image_url": "data:image/png;base64,AAAA"}],
                }
            ],
            max_output_tokens=MAX_TOKENS,
        )
    # The chat path's 400 in this request's terms: the part named as the Responses one.
    assert caught.value.body["param"] == "input"
    assert "input[0].content[0]" in caught.value.body["message"]


def test_a_slow_image_host_holds_up_only_its_own_request(
    client: openai.OpenAI, expected: list[str]
) -> None:
    """An image on a host that has not answered yet: a text request sent meanwhile to the same
    ingress is tokenized and answered (images are read on their own threads, not the
    tokenizer's); the image request answers once the host does."""
    body = io.BytesIO()
    _images()[0].save(body, format="PNG")
    asked, release = threading.Event(), threading.Event()

    class SlowHost(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.set()
            release.wait(60)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body.getvalue())))
            self.end_headers()
            self.wfile.write(body.getvalue())

        def log_message(self, *args: object) -> None:
            pass

    host = ThreadingHTTPServer(("127.0.0.1", 0), SlowHost)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{host.server_address[1]}/image.png"
    quick = client.with_options(timeout=30)
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            slow = pool.submit(_chat, client, [_image(url), TEXT])
            assert asked.wait(60), "the server never fetched the image"
            text = _chat(quick, [TEXT])  # would wait on the held fetch on a shared thread
            assert text.choices[0].message.content == expected[0]
            assert not slow.done()
            release.set()
            assert slow.result(timeout=120).choices[0].message.content == expected[1]
    finally:
        release.set()
        host.shutdown()
