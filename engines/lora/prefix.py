"""A prefix holding one PEFT adapter folder per name, read on first use: a request naming an
adapter the engine was not given is looked up as PREFIX/NAME (`adapter_config.json` there).

Local prefixes are read in place. An `s3://` prefix is downloaded once per node into a cache
folder (PREFIX/NAME's files into CACHE/<prefix digest>/NAME, written beside and renamed into
place under a lock, so concurrent engines on a node fetch it once and never see half of it).
S3 credentials come from the environment, as for every other read of the job's storage; the
settings carry only where the storage is (endpoint, region, anonymous). The engines take the
prefix as plain data (`lora_prefix`), so they stay free of the pipeline's storage code.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engines.lora.peft import CONFIG_FILE, AdapterError

# What a name found under a prefix may be: one path component, no hidden or parent folders.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+=-]{0,127}$")
_FIELDS = ("uri", "cache_dir", "endpoint_url", "region", "anonymous")


class AdapterPrefix:
    """Adapter folders under `uri` (a local folder or s3://bucket/prefix), by name."""

    def __init__(
        self,
        uri: str,
        cache_dir: str = "~/.cache/tokenmill/adapters",
        endpoint_url: str | None = None,
        region: str | None = None,
        anonymous: bool = False,
    ) -> None:
        self.uri = uri.rstrip("/")
        self._s3 = self.uri.startswith("s3://")
        self._cache = Path(os.path.expanduser(cache_dir))
        self._options = {"endpoint_url": endpoint_url, "region": region, "anon": anonymous}
        self._fs: Any = None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, settings: Mapping[str, Any] | None) -> AdapterPrefix | None:
        """From an engine's `lora_prefix` setting ({uri, cache_dir, endpoint_url, region,
        anonymous}); None: no prefix."""
        if not settings:
            return None
        unknown = sorted(set(settings) - set(_FIELDS))
        if unknown or not settings.get("uri"):
            raise AdapterError(
                f"lora_prefix: give uri (and optionally {', '.join(_FIELDS[1:])}); "
                f"unknown: {', '.join(unknown) or 'none'}"
            )
        return cls(**dict(settings))

    def folder(self, name: str) -> str:
        """The local folder of adapter `name` under this prefix (fetched if remote);
        AdapterError naming the adapter and the place looked at when there is none."""
        if not _NAME.match(name):
            raise AdapterError(
                f"unknown adapter {name!r}: not a name that can be looked up under {self.uri} "
                "(one folder name: letters, digits and ._@+=-)"
            )
        if not self._s3:
            local = Path(os.path.expanduser(self.uri.removeprefix("file://"))) / name
            if not (local / CONFIG_FILE).is_file():
                raise AdapterError(
                    f"unknown adapter {name!r}: no {CONFIG_FILE} at {local} (the adapter prefix)"
                )
            return str(local)
        return str(self._fetch(name))

    # --- s3 --------------------------------------------------------------------------------

    def _filesystem(self) -> Any:
        with self._lock:
            if self._fs is None:
                import s3fs

                client: dict[str, Any] = {}
                if self._options["endpoint_url"]:
                    client["endpoint_url"] = self._options["endpoint_url"]
                if self._options["region"]:
                    client["region_name"] = self._options["region"]
                self._fs = s3fs.S3FileSystem(
                    anon=bool(self._options["anon"]),
                    client_kwargs=client,
                    use_listings_cache=False,
                )
            return self._fs

    def _fetch(self, name: str) -> Path:
        digest = hashlib.sha256(self.uri.encode()).hexdigest()[:16]
        root = self._cache / digest
        target = root / name
        if (target / CONFIG_FILE).is_file():
            return target
        fs = self._filesystem()
        remote = f"{self.uri.removeprefix('s3://')}/{name}"
        try:
            listed = [p for p in fs.find(remote) if not p.endswith("/")]
        except Exception as exc:  # the storage's own error, named with the place
            raise AdapterError(f"adapter {name!r}: cannot list s3://{remote}: {exc}") from None
        if f"{remote}/{CONFIG_FILE}" not in listed:
            raise AdapterError(
                f"unknown adapter {name!r}: no {CONFIG_FILE} under s3://{remote} (the adapter "
                "prefix)"
            )
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if (target / CONFIG_FILE).is_file():  # another engine on the node fetched it
                return target
            partial = root / f".{name}.partial"
            shutil.rmtree(partial, ignore_errors=True)
            try:
                for path in listed:
                    dest = partial / path[len(remote) + 1 :]
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    fs.get_file(path, str(dest))
            except Exception as exc:
                shutil.rmtree(partial, ignore_errors=True)
                problem = f"adapter {name!r}: download from s3://{remote}: {exc}"
                raise AdapterError(problem) from None
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(target)
            partial.rename(target)
        return target
