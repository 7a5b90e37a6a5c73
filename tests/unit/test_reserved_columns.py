"""The spec's literal list of reserved columns is the batch schema's computed one."""

from pipeline.batch.stages.schema import RESERVED_COLUMNS as COMPUTED
from pipeline.spec.reserved import RESERVED_COLUMNS


def test_the_spec_reserves_exactly_the_columns_batch_writes():
    assert RESERVED_COLUMNS == COMPUTED
