"""The in-process `Dataset` pipeline API (tf.data's semantics, numpy elements).

What each module owns, and how they layer, is the "Modules" paragraph of dataset.py's
docstring. The service (dispatcher, worker, client) walks and rewrites a pipeline only
through `graph.py` and `static_sharding.py`.
"""

from dataservice.data.batching_ops import DatasetSpec
from dataservice.data.dataset import (
    AUTOTUNE,
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    Dataset,
    IterContext,
)
from dataservice.data.parquet import ParquetDataset
from dataservice.data.serialize import deserialize, fingerprint, serialize
from dataservice.data.sources import TFRecordDataset
from dataservice.data.splits import SplitProvider
from dataservice.data.structure import TensorSpec
from dataservice.data.webdataset import WebDataset

__all__ = [
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "UNKNOWN_CARDINALITY",
    "Dataset",
    "DatasetSpec",
    "IterContext",
    "ParquetDataset",
    "SplitProvider",
    "TFRecordDataset",
    "TensorSpec",
    "WebDataset",
    "deserialize",
    "fingerprint",
    "serialize",
]
