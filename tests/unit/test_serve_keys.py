"""The keys file: parsing and validation (errors name file, entry and field, never a value),
key lookup, and reload (a change, a removal, a broken edit keeps the last good set)."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest
import yaml

from pipeline.serve.access.auth import KeyDigests, load_key_digests
from pipeline.serve.access.keys import (
    ANONYMOUS,
    KeyFileError,
    KeyFileWatcher,
    KeyRing,
    load_key_file,
    parse_key_file,
)
from pipeline.serve.spec import AuthSpec


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer(key: str) -> str:
    return f"Bearer {key}"


ENTRIES = [
    {
        "name": "team-a",
        "sha256": sha("key-a"),
        "limits": {"requests_per_minute": 60, "tokens_per_minute": 1000, "max_concurrent": 2},
        "models": ["tiny"],
        "metrics": True,
    },
    {"name": "team-b", "sha256": sha("key-b").upper()},
]


def write(path: Path, entries: list[dict]) -> Path:
    path.write_text(yaml.safe_dump({"keys": entries}))
    return path


def test_a_valid_file_parses_in_yaml_and_json(tmp_path: Path) -> None:
    import json

    from_yaml = load_key_file(write(tmp_path / "keys.yaml", ENTRIES))
    (tmp_path / "keys.json").write_text(json.dumps({"keys": ENTRIES}))
    from_json = load_key_file(tmp_path / "keys.json")
    assert from_yaml == from_json
    a, b = from_yaml.keys
    assert a.limits.requests_per_minute == 60 and a.models == ["tiny"] and a.metrics
    assert b.sha256 == sha("key-b")  # upper-case hex is accepted, stored lower-case
    assert b.limits.unlimited and b.models is None and not b.metrics
    assert parse_key_file("", "empty.yaml").keys == []  # every key revoked


@pytest.mark.parametrize(
    ("entry", "where", "says"),
    [
        ({"name": "x", "sha256": "abc"}, "keys[0] (name 'x').sha256", "64 hex digits"),
        ({"name": "x"}, "keys[0] (name 'x').sha256", "required"),
        (
            {"name": "x", "sha256": sha("k"), "limits": {"requests_per_minute": 0}},
            "keys[0] (name 'x').limits.requests_per_minute",
            "greater than or equal to 1",
        ),
        (
            {"name": "x", "sha256": sha("k"), "limits": {"rpm": 5}},
            "keys[0] (name 'x').limits.rpm",
            "unknown field",
        ),
        ({"name": "env-1", "sha256": sha("k")}, "keys[0] (name 'env-1').name", "choose another"),
        ({"name": "bad name", "sha256": sha("k")}, "keys[0] (name 'bad name').name", "pattern"),
    ],
)
def test_errors_name_file_entry_and_field(entry: dict, where: str, says: str) -> None:
    with pytest.raises(KeyFileError) as err:
        parse_key_file(yaml.safe_dump({"keys": [entry]}), "/etc/keys.yaml")
    message = str(err.value)
    assert message.startswith("/etc/keys.yaml: ")
    assert where in message and says in message


def test_errors_never_quote_a_value() -> None:
    pasted = "sk-live-0123456789abcdef"
    for text in (
        yaml.safe_dump({"keys": [{"name": "x", "sha256": pasted}]}),
        yaml.safe_dump({"keys": [{"name": "x", "key": pasted, "sha256": sha("k")}]}),
        f"keys:\n  - name: x\n    sha256: [{pasted}\n",  # broken YAML on the key's line
    ):
        with pytest.raises(KeyFileError) as err:
            parse_key_file(text, "keys.yaml")
        assert pasted not in str(err.value)
    with pytest.raises(KeyFileError, match="holds digests, never keys"):
        parse_key_file(
            yaml.safe_dump({"keys": [{"name": "x", "key": pasted, "sha256": sha("k")}]}), "f"
        )


def test_duplicates_and_shape_are_refused() -> None:
    twice = [{"name": "a", "sha256": sha("1")}, {"name": "a", "sha256": sha("2")}]
    with pytest.raises(KeyFileError, match=r"keys\[1\] has the same name 'a' as keys\[0\]"):
        parse_key_file(yaml.safe_dump({"keys": twice}), "f")
    same_key = [{"name": "a", "sha256": sha("1")}, {"name": "b", "sha256": sha("1")}]
    with pytest.raises(KeyFileError, match=r"keys\[1\] has the same sha256 as keys\[0\]"):
        parse_key_file(yaml.safe_dump({"keys": same_key}), "f")
    with pytest.raises(KeyFileError, match="expected a mapping"):
        parse_key_file("- a\n- b\n", "f")
    with pytest.raises(KeyFileError, match="cannot read it"):
        load_key_file("/nonexistent/keys.yaml")


def test_ring_identifies_named_and_environment_keys(tmp_path: Path) -> None:
    static = load_key_digests(AuthSpec(), env={"TOKENMILL_API_KEYS": "env-key, other"})
    ring = KeyRing.build(static, load_key_file(write(tmp_path / "k.yaml", ENTRIES)))
    a = ring.identify(bearer("key-a"))
    assert a is not None and a.name == "team-a" and a.limits.max_concurrent == 2
    assert a.allows("tiny") and not a.allows("other-model")
    env = ring.identify(bearer("env-key"))
    assert env is not None and env.name == "env-1" and env.limits.unlimited and env.metrics
    assert ring.identify(bearer("other")).name == "env-2"
    for header in (None, "", "Bearer", "Bearer nope", "Basic key-a", "key-a"):
        assert ring.identify(header) is None
    assert ring.names == ["env-1", "env-2", "team-a", "team-b"]
    assert "key-a" not in repr(ring.__dict__) and "env-key" not in repr(static)
    # Batch API owners: the entry's name, a plaintext key's digest (never its position).
    assert a.owner == "team-a"
    assert env.owner == f"sha256/{hashlib.sha256(b'env-key').hexdigest()}"
    swapped = load_key_digests(AuthSpec(), env={"TOKENMILL_API_KEYS": "other,env-key"})
    moved = KeyRing.build(swapped, None).identify(bearer("env-key"))
    assert moved is not None and moved.name == "env-2" and moved.owner == env.owner


def test_insecure_ring_names_the_caller_anonymous() -> None:
    ring = KeyRing.build(KeyDigests(frozenset(), insecure=True), None)
    caller = ring.identify(None)
    assert caller is not None and caller.name == ANONYMOUS and caller.metrics
    assert caller.owner is None  # no files or batches of its own: the Batch API refuses it


def test_a_keys_file_alone_is_a_key_source(tmp_path: Path) -> None:
    keys = load_key_digests(AuthSpec(keys_file=str(tmp_path / "k.yaml")), env={})
    assert not keys.insecure and not keys.digests


def test_reload_adds_removes_and_survives_a_broken_edit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path / "keys.yaml", ENTRIES)
    watcher = KeyFileWatcher(KeyDigests(frozenset()), str(path), interval_s=0.05)
    assert watcher.ring.identify(bearer("key-b")).name == "team-b"
    assert watcher.poll() is False  # unchanged

    # A change: team-b removed, team-c added, team-a's limits changed.
    changed = [
        {**ENTRIES[0], "limits": {"requests_per_minute": 5}},
        {"name": "team-c", "sha256": sha("key-c")},
    ]
    write(path, changed)
    assert watcher.poll() is True
    assert watcher.ring.identify(bearer("key-b")) is None
    assert watcher.ring.identify(bearer("key-c")).name == "team-c"
    assert watcher.ring.identify(bearer("key-a")).limits.requests_per_minute == 5

    # A broken edit: logged once (file, entry, field; no value), the last good set stays.
    caplog.set_level(logging.ERROR, logger="pipeline.serve.access.keys")
    path.write_text(yaml.safe_dump({"keys": [{"name": "team-c", "sha256": "key-c"}]}))
    assert watcher.poll() is False
    assert watcher.poll() is False
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert str(path) in errors[0] and "keys[0] (name 'team-c').sha256" in errors[0]
    assert "key-c" not in errors[0].replace("'team-c'", "")
    assert watcher.ring.identify(bearer("key-c")).name == "team-c"
    assert watcher.last_error is not None

    # The file disappearing (a secret being remounted) keeps the set too.
    path.unlink()
    assert watcher.poll() is False and watcher.ring.identify(bearer("key-a")) is not None

    # Fixed again: it takes effect.
    write(path, [ENTRIES[1]])
    assert watcher.poll() is True and watcher.last_error is None
    assert watcher.ring.names == ["team-b"]


def test_the_watcher_thread_picks_up_a_removal(tmp_path: Path) -> None:
    import time

    path = write(tmp_path / "keys.yaml", ENTRIES)
    watcher = KeyFileWatcher(KeyDigests(frozenset()), str(path), interval_s=0.05)
    watcher.start()
    try:
        write(path, [ENTRIES[0]])
        deadline = time.monotonic() + 5
        while watcher.ring.identify(bearer("key-b")) is not None:
            assert time.monotonic() < deadline, "removal not seen"
            time.sleep(0.02)
    finally:
        watcher.stop()


def test_a_broken_file_at_start_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("keys: [")
    with pytest.raises(KeyFileError, match="not valid YAML"):
        KeyFileWatcher(KeyDigests(frozenset()), str(path))


def _kubernetes_update(mount: Path, version: str, entries: list[dict]) -> Path:
    """Write the keys file into `mount` as the kubelet updates a secret volume: the files go
    into a new timestamped directory, `..data` is re-pointed at it by renaming a fresh symlink
    over it (atomic), and the old directory is removed. `keys.yaml` itself is a symlink to
    `..data/keys.yaml` that never changes, so its own mtime (lstat) says nothing."""
    new = mount / f"..2025_01_01_00_00_0{version}.000000001"
    new.mkdir()
    (new / "keys.yaml").write_text(yaml.safe_dump({"keys": entries}))
    data = mount / "..data"
    old = data.resolve() if data.is_symlink() else None
    tmp = mount / "..data_tmp"
    tmp.symlink_to(new.name)
    tmp.rename(data)
    link = mount / "keys.yaml"
    if not link.is_symlink():
        link.symlink_to("..data/keys.yaml")
    if old is not None:
        # Same size and mtime as the new file: only the content tells them apart.
        stat = (new / "keys.yaml").stat()
        os.utime(new / "keys.yaml", ns=(stat.st_atime_ns, (old / "keys.yaml").stat().st_mtime_ns))
        for child in old.iterdir():
            child.unlink()
        old.rmdir()
    return link


def test_reload_sees_a_kubernetes_secret_update(tmp_path: Path) -> None:
    mount = tmp_path / "serve-keys"
    mount.mkdir()
    limits = {"requests_per_minute": 10}
    before = [{"name": "team-a", "sha256": sha("key-a"), "limits": limits}]
    path = _kubernetes_update(mount, "1", before)
    watcher = KeyFileWatcher(KeyDigests(frozenset()), str(path), interval_s=0.05)
    assert watcher.ring.identify(bearer("key-a")).limits.requests_per_minute == 10
    link_mtime = os.lstat(path).st_mtime_ns

    # The same key with another limit of the same length: same size, same mtime.
    after = [{"name": "team-a", "sha256": sha("key-a"), "limits": {"requests_per_minute": 20}}]
    _kubernetes_update(mount, "2", after)
    assert os.lstat(path).st_mtime_ns == link_mtime  # the symlink itself did not change
    assert watcher.poll() is True
    assert watcher.ring.identify(bearer("key-a")).limits.requests_per_minute == 20
    assert watcher.poll() is False

    # A revocation arrives the same way.
    _kubernetes_update(mount, "3", [{"name": "team-b", "sha256": sha("key-b")}])
    assert watcher.poll() is True
    assert watcher.ring.identify(bearer("key-a")) is None
    assert watcher.ring.names == ["team-b"]
