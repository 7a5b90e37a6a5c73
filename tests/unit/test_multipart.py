"""multipart/form-data read in pieces (pipeline.serve.batch_api.multipart): whatever the pieces, the
same parts and bytes come out as from the whole body."""

from __future__ import annotations

import pytest

from pipeline.serve.batch_api.multipart import (
    MAX_HEADER_BYTES,
    MultipartError,
    MultipartReader,
    PartData,
    PartEnd,
    PartStart,
)

CONTENT_TYPE = 'multipart/form-data; boundary="b0und"'
BODY = (
    b"preamble to ignore\r\n"
    b"--b0und\r\n"
    b'Content-Disposition: form-data; name="purpose"\r\n\r\n'
    b"batch\r\n"
    b"--b0und\r\n"
    b'Content-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
    b"Content-Type: application/jsonl\r\n\r\n"
    b'{"a": 1}\r\n--b0un not a boundary\r\n{"b": 2}\n'
    b"\r\n--b0und--\r\n"
    b"epilogue"
)


def _parts(pieces: list[bytes]) -> list[tuple[str | None, str | None, bytes]]:
    reader = MultipartReader(CONTENT_TYPE)
    parts: list[tuple[str | None, str | None, bytes]] = []
    data = b""
    for piece in pieces:
        for event in reader.feed(piece):
            if isinstance(event, PartStart):
                parts.append((event.name, event.filename, b""))
                data = b""
            elif isinstance(event, PartData):
                data += event.data
            elif isinstance(event, PartEnd):
                name, filename, _ = parts[-1]
                parts[-1] = (name, filename, data)
    reader.close()
    return parts


def test_the_same_parts_whatever_the_pieces() -> None:
    whole = _parts([BODY])
    assert whole == [
        ("purpose", None, b"batch"),
        ("file", "in.jsonl", b'{"a": 1}\r\n--b0un not a boundary\r\n{"b": 2}\n'),
    ]
    for size in range(1, 40):
        pieces = [BODY[i : i + size] for i in range(0, len(BODY), size)]
        assert _parts(pieces) == whole, size
    for cut in range(len(BODY)):  # every place a boundary can be split at
        assert _parts([BODY[:cut], BODY[cut:]]) == whole, cut


def test_refusals_name_the_problem() -> None:
    with pytest.raises(MultipartError, match="not multipart/form-data"):
        MultipartReader("application/json")
    with pytest.raises(MultipartError, match="no boundary"):
        MultipartReader("multipart/form-data")
    reader = MultipartReader(CONTENT_TYPE)
    reader.feed(BODY[: BODY.index(b"\r\n--b0und--")])
    with pytest.raises(MultipartError, match="closing boundary"):
        reader.close()
    reader = MultipartReader(CONTENT_TYPE)
    with pytest.raises(MultipartError, match="headers are over"):
        reader.feed(b"--b0und\r\n" + b"X-Long: " + b"x" * MAX_HEADER_BYTES)


def test_data_is_handed_on_as_it_arrives() -> None:
    reader = MultipartReader(CONTENT_TYPE)
    reader.feed(b'--b0und\r\nContent-Disposition: form-data; name="file"\r\n\r\n')
    events = reader.feed(b"x" * 100_000)
    # All but what could begin the next boundary, at once: nothing piles up in the reader.
    assert sum(len(e.data) for e in events if isinstance(e, PartData)) >= 100_000 - 10
