"""dataservice: a data service for ML training, as tf.data service without TensorFlow.

A dispatcher and a fleet of workers run plain-Python input pipelines (any
function, numpy, Pillow) and stream numpy elements to training processes.
The public names mirror `tf.data.experimental.service`; see API.md.

    import dataservice as ds
    dataset = ds.Dataset.range(10).map(lambda x: x * 2)
    dataset = dataset.apply(ds.distribute(ds.ShardingPolicy.OFF, "grpc://localhost:5050"))
"""

from dataservice import errors, io
from dataservice.client.api import (
    CrossTrainerCache,
    DistributedDataset,
    distribute,
    from_dataset_id,
    register_dataset,
)
from dataservice.client.checkpoint import merge_state_dicts
from dataservice.cluster import LocalCluster
from dataservice.config import DispatcherConfig, WorkerConfig
from dataservice.data.dataset import (
    AUTOTUNE,
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    Dataset,
)
from dataservice.data.parquet import ParquetDataset
from dataservice.data.sources import TFRecordDataset
from dataservice.data.structure import TensorSpec
from dataservice.data.webdataset import WebDataset
from dataservice.dispatcher.server import DispatchServer
from dataservice.sharding import SHARD_HINT, ShardingPolicy
from dataservice.worker.server import WorkerServer

__version__ = "0.1.0"

__all__ = [
    "AUTOTUNE",
    "CrossTrainerCache",
    "Dataset",
    "DispatchServer",
    "DispatcherConfig",
    "DistributedDataset",
    "INFINITE_CARDINALITY",
    "LocalCluster",
    "ParquetDataset",
    "SHARD_HINT",
    "ShardingPolicy",
    "TFRecordDataset",
    "TensorSpec",
    "UNKNOWN_CARDINALITY",
    "WorkerConfig",
    "WebDataset",
    "WorkerServer",
    "distribute",
    "merge_state_dicts",
    "errors",
    "from_dataset_id",
    "io",
    "register_dataset",
]
