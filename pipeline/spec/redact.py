"""What of a job's settings may be written down or hashed: the manifest's copy of the spec, a
Ray Data source's fingerprint and its staging snapshot (`_snapshot.json`).

Job files hold no credentials by design (storage credentials come from the environment), but
two places take free-form maps a user fills from a library's documentation: `input.reader_args`
(a `ray.data` reader's keyword arguments) and the connection settings inside them
(`storage_options`, `catalog_kwargs`, ...). Every library names its secrets differently
(pyiceberg's `token` and `s3.secret-access-key`, deltalake's `account_key`, `sas_token`,
`google_service_account_key`, ...), so a list of secret names is always one name short. The
rule is the other way round, by what is safe to keep:

- In a reader's arguments, a settings map (the value of an argument named `*options`,
  `*kwargs`, `*properties`, `*config`, `*params`, `*parameters`, `*settings`, or `headers`)
  keeps only the keys known to say *where* the data is (SAFE_SETTINGS: endpoints, regions,
  catalog and table names, account and container names, ...); every other value in it is
  masked.
- Anywhere else, a value under a key that looks like a credential (CREDENTIAL: anything with
  token, key, secret, password, signature, auth, session, private, sas, ...) is masked.
- Every string loses a URI's `user:password@` and the values of query parameters that look
  like credentials (a pre-signed or SAS URL's signature).

A masked value is neither written nor hashed: rotating a credential keeps a snapshot's
fingerprint, and the fingerprint leaks nothing about it. Masking a setting that was not a
secret costs only this: changing it alone does not change the fingerprint.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

REDACTED = "***"

# Key names (lower case, with '-', '.', ' ' read as '_') whose values are credentials. A
# segment match, singular: "max_tokens" and "kv_cache_tokens" are counts, "stop_token_ids"
# token ids, not tokens.
CREDENTIAL = re.compile(
    r"(^|_)(secrets?|passwords?|passwd|pwd|passphrase|credentials?|token(?!_ids?$)|keys?|sas|sig|"
    r"signatures?|auth|authorization|bearer|apikey|session|private|cookies?|cert|"
    r"certificate|oauth\d*|jwt|otp|connection_string|conn_str|dsn_password)(_|$)"
)
# Argument names whose value is a map of connection settings (allowlisted, see above).
_SETTINGS_MAP = re.compile(
    r"(options|kwargs|properties|config|params|parameters|settings|headers)$"
)
# Keys of a settings map that are kept: they locate the data and hold no secret.
SAFE_SETTINGS = frozenset(
    {
        "name",
        "type",
        "uri",
        "url",
        "warehouse",
        "catalog",
        "catalog_name",
        "namespace",
        "database",
        "schema",
        "table",
        "project",
        "project_id",
        "google_project_id",
        "endpoint",
        "endpoint_url",
        "endpoint_override",
        "aws_endpoint",
        "aws_endpoint_url",
        "s3_endpoint",
        "region",
        "region_name",
        "aws_region",
        "s3_region",
        "client_region",
        "allow_http",
        "aws_allow_http",
        "virtual_hosted_style_request",
        "aws_virtual_hosted_style_request",
        "s3_path_style_access",
        "account_name",
        "azure_storage_account_name",
        "adls_account_name",
        "container",
        "container_name",
        "bucket",
        "py_io_impl",
        "io_impl",
        "use_ssl",
        "verify",
        "timeout",
        "connect_timeout",
        "read_timeout",
        "max_retries",
    }
)


def _normal(key: Any) -> str:
    return re.sub(r"[-. ]", "_", str(key).lower())


def is_credential(key: Any) -> bool:
    """Whether a key name looks like one a credential is kept under."""
    return CREDENTIAL.search(_normal(key)) is not None


def redact(value: Any) -> Any:
    """A copy of `value` (a spec dump, or any part of one) safe to write down or hash: masked
    credential-like keys, cleaned URIs, and `reader_args` read as a reader's arguments."""
    if isinstance(value, dict):
        return {k: _redact_entry(k, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return _clean_uri(value)
    return value


def redact_reader_args(args: dict[str, Any]) -> dict[str, Any]:
    """A reader's keyword arguments (input.reader_args) safe to write down or hash: settings
    maps keep only SAFE_SETTINGS, and the rest as `redact`."""
    return {
        k: _settings(v)
        if isinstance(v, dict) and _SETTINGS_MAP.search(_normal(k)) and not is_credential(k)
        else _redact_entry(k, v)
        for k, v in args.items()
    }


def _redact_entry(key: Any, value: Any) -> Any:
    if value is None:
        return None
    if is_credential(key):
        return REDACTED
    if key == "reader_args" and isinstance(value, dict):
        return redact_reader_args(value)
    return redact(value)


def _settings(values: dict[str, Any]) -> dict[str, Any]:
    return {k: _setting(k, v) for k, v in values.items()}


def _setting(key: Any, value: Any) -> Any:
    if value is None:
        return None
    if _normal(key) in SAFE_SETTINGS and not isinstance(value, (dict, list)):
        return _clean_uri(value) if isinstance(value, str) else value
    return REDACTED


_URI = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def _clean_uri(text: str) -> str:
    """`text` without a URI's user:password@ and credential-like query values."""
    if not _URI.match(text):
        return text
    try:
        parts = urlsplit(text)
    except ValueError:
        return re.sub(r"(?<=://)[^/@\s]+@", REDACTED + "@", text)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = REDACTED + "@" + netloc.rsplit("@", 1)[1]
    query = parts.query
    if query:
        # A pre-signed URL's signature (X-Amz-Signature, X-Amz-Credential, an Azure SAS's sig)
        # and any token or key in it.
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(is_credential(k) for k, _ in pairs):
            query = urlencode(
                [(k, REDACTED if is_credential(k) else v) for k, v in pairs], safe="*"
            )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
