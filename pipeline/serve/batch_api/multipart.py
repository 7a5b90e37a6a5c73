"""multipart/form-data read as it arrives (RFC 7578): an upload streams through to storage in
parts and is never held whole.

`MultipartReader.feed` takes the body in whatever pieces the server hands over and returns
what they completed: a part's start (its form field name and filename), its data, its end.
Data is handed on as soon as it cannot be the start of the next boundary, so the reader keeps
at most one piece plus a boundary's length; part headers are bounded by MAX_HEADER_BYTES.
"""

from __future__ import annotations

import email.message
from dataclasses import dataclass

MAX_HEADER_BYTES = 16 * 1024  # one part's headers; real clients send a few hundred bytes


class MultipartError(ValueError):
    """The body is not multipart/form-data this reader can follow; the message says why."""


@dataclass(frozen=True)
class PartStart:
    name: str | None  # the form field (Content-Disposition name); None: unnamed, ignored
    filename: str | None


@dataclass(frozen=True)
class PartData:
    data: bytes


@dataclass(frozen=True)
class PartEnd:
    pass


Event = PartStart | PartData | PartEnd


def boundary_of(content_type: str) -> bytes:
    """The boundary a multipart/form-data Content-Type names; MultipartError otherwise."""
    message = email.message.Message()
    message["content-type"] = content_type
    if message.get_content_type() != "multipart/form-data":
        raise MultipartError("the body is not multipart/form-data")
    boundary = message.get_param("boundary")
    if not isinstance(boundary, str) or not 1 <= len(boundary) <= 200:
        raise MultipartError("the multipart/form-data Content-Type names no boundary")
    return boundary.encode("latin-1")


class MultipartReader:
    """One body's parts, fed piece by piece (see the module docstring)."""

    def __init__(self, content_type: str) -> None:
        self._delimiter = b"\r\n--" + boundary_of(content_type)
        # The first delimiter has no line break before it: pretend there was one.
        self._buffer = bytearray(b"\r\n")
        self._state = "preamble"  # preamble, headers, data, delimiter, done

    def feed(self, chunk: bytes) -> list[Event]:
        if self._state == "done":
            return []  # the epilogue, ignored
        self._buffer += chunk
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def close(self) -> None:
        """The body ended: MultipartError unless its closing boundary was seen."""
        if self._state != "done":
            raise MultipartError("the multipart body ended before its closing boundary")

    def _step(self, events: list[Event]) -> bool:
        """Advance by what the buffer allows; False when it needs more bytes."""
        buffer = self._buffer
        if self._state in ("preamble", "data"):
            at = buffer.find(self._delimiter)
            if at < 0:
                # Keep what could be the start of a delimiter split between two pieces.
                keep = len(self._delimiter) - 1
                if len(buffer) > keep and self._state == "data":
                    events.append(PartData(bytes(buffer[:-keep])))
                if len(buffer) > keep:
                    del buffer[:-keep]
                return False
            if self._state == "data":
                if at:
                    events.append(PartData(bytes(buffer[:at])))
                events.append(PartEnd())
            del buffer[: at + len(self._delimiter)]
            self._state = "delimiter"
            return True
        if self._state == "delimiter":
            if len(buffer) < 2:
                return False
            if buffer[:2] == b"--":
                self._state = "done"
                buffer.clear()
                return False
            if buffer[:2] != b"\r\n":
                raise MultipartError("a multipart boundary is not followed by a line break")
            del buffer[:2]
            self._state = "headers"
            return True
        # headers
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > MAX_HEADER_BYTES:
                raise MultipartError(f"a part's headers are over {MAX_HEADER_BYTES} bytes")
            return False
        events.append(_part_start(bytes(buffer[:end])))
        del buffer[: end + 4]
        self._state = "data"
        return True


def _part_start(block: bytes) -> PartStart:
    message = email.message.Message()
    for line in block.decode("utf-8", errors="replace").split("\r\n"):
        name, colon, value = line.partition(":")
        if colon:
            message[name.strip()] = value.strip()
    if message.get("content-disposition") is None:
        return PartStart(None, None)
    name = message.get_param("name", header="content-disposition")
    return PartStart(name if isinstance(name, str) else None, message.get_filename())
