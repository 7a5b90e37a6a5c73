"""Spec validation of a ray_data source (input.reader / input.dataset): no I/O, ray.data imported
when called."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pipeline.spec.base import SpecError

if TYPE_CHECKING:
    from ray.data import Dataset


# `ray.data.read_*` names that are not readers a job file can call: a module, and the generic
# entry that takes a Datasource object (no YAML value is one).
_NOT_READERS = frozenset({"read_api", "read_datasource"})

_FUNCTION_REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def reader_names() -> list[str]:
    """The `ray.data` readers a job can name, sorted."""
    import ray.data

    return sorted(
        name
        for name in dir(ray.data)
        if name.startswith("read_")
        and name not in _NOT_READERS
        and callable(getattr(ray.data, name))
    )


def resolve_reader(name: str) -> Callable[..., Dataset]:
    """`ray.data.<name>`; SpecError naming input.reader and the accepted names otherwise."""
    import ray.data

    names = reader_names()
    if name not in names:
        raise SpecError(
            f"input.reader: {name!r} is not a ray.data reader; use one of: {', '.join(names)}"
        )
    return getattr(ray.data, name)  # type: ignore[no-any-return]


def check_source(reader: str | None, args: dict[str, Any], dataset: str | None) -> None:
    """Spec validation of a ray_data source: one of reader / dataset, a known reader, arguments
    it accepts (a missing required one or an unknown name is an error naming the field)."""
    if (reader is None) == (dataset is None):
        raise SpecError(
            "input.format ray_data needs exactly one of input.reader (a ray.data reader by "
            "name, e.g. read_iceberg) or input.dataset ('module:function' returning a Dataset)"
        )
    if dataset is not None:
        if not _FUNCTION_REF.match(dataset):
            raise SpecError(
                f"input.dataset: {dataset!r} is not 'module:function' (e.g. my_jobs.data:prompts)"
            )
        return
    assert reader is not None
    function = resolve_reader(reader)
    try:
        inspect.signature(function).bind(**args)
    except TypeError as exc:
        raise SpecError(
            f"input.reader_args: {reader} {exc} (given: {sorted(args) or 'none'}); see the "
            f"arguments of ray.data.{reader}"
        ) from None
