"""The `Dataset` methods of the ops in batching_ops.py, mixing_ops.py, cache_ops.py and
error_ops.py: a mixin that `Dataset` inherits, so dataset.py stays the size of one
module. Each method imports its op class when called (dataset.py's "Modules").

README.md's "Pipeline ops" table lists every op with where it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dataservice.data.dataset import Dataset

__all__ = ["MoreOpsMixin"]


class MoreOpsMixin:
    """`unbatch`, `padded_batch`, `rebatch`, `window`, `bucket_by_sequence_length`,
    `cache`, `ignore_errors`, `sample_from_datasets`, `choose_from_datasets`."""

    def unbatch(self: Dataset) -> Dataset:  # type: ignore[misc]
        """Each element's rows as elements: the inverse of `batch`.

        >>> from dataservice import Dataset
        >>> [int(x) for x in Dataset.range(5).batch(2).unbatch()]
        [0, 1, 2, 3, 4]

        Every leaf of an element is split along axis 0 (rows are copies, not views of
        the batch; a row of a batch of strings is a `str` / `bytes`). Splits pass
        through (DYNAMIC keeps working). Cardinality: n * batch size when the input's
        spec has a static batch size (`batch(k, drop_remainder=True)`), else UNKNOWN
        (INFINITE stays).

        Raises:
            InvalidArgumentError: An element has a scalar leaf (now when the spec is
                static, else while iterating), or leaves of different sizes in axis 0.
        """
        from dataservice.data.batching_ops import UnbatchDataset  # see "Modules"

        return UnbatchDataset(self)

    def padded_batch(  # type: ignore[misc]
        self: Dataset,
        batch_size: int,
        padded_shapes: Any = None,
        padding_values: Any = None,
        drop_remainder: bool = False,
    ) -> Dataset:
        """Consecutive elements batched, each leaf padded to a common shape.

        >>> import numpy as np
        >>> from dataservice import Dataset
        >>> ds = Dataset.range(1, 4).map(lambda x: np.full(x, x))
        >>> [b.tolist() for b in ds.padded_batch(2)]
        [[[1, 0], [2, 2]], [[3, 3, 3]]]

        Args:
            batch_size: Elements per batch (> 0).
            padded_shapes: A nest matching the elements' structure (a single shape
                for a single-leaf element), each leaf a shape (list of sizes; None or
                -1: the largest size in the batch) or a `TensorSpec`. None: tf.data's
                rule, the dimensions the input's static spec knows stay, the others
                are padded to the batch's largest; when the input's spec is not static
                (after a `map`) every dimension is padded to the batch's largest.
            padding_values: A scalar per leaf (a nest, None entries for the default:
                0, "" or b""), or one scalar for every leaf.
            drop_remainder: Drop the last, smaller batch.
        Raises:
            InvalidArgumentError: `batch_size` <= 0; `padded_shapes` or
                `padding_values` do not match the elements (a rank, a structure, a
                value that is not a scalar); while iterating, an element larger than
                its padded shape ("Attempted to pad to a smaller size").
        """
        from dataservice.data.batching_ops import PaddedBatchDataset  # see "Modules"

        return PaddedBatchDataset(self, batch_size, padded_shapes, padding_values, drop_remainder)

    def rebatch(  # type: ignore[misc]
        self: Dataset, batch_size: int | Sequence[int], drop_remainder: bool = False
    ) -> Dataset:
        """The rows of the input's batches in batches of `batch_size`: the same as
        `unbatch().batch(batch_size, drop_remainder)`, with one copy.

        >>> from dataservice import Dataset
        >>> [b.tolist() for b in Dataset.range(7).batch(4).rebatch(3)]
        [[0, 1, 2], [3, 4, 5], [6]]

        Args:
            batch_size: An int > 0, or a list of them used in turn.
            drop_remainder: Drop the rows left over at the end.
        Raises:
            InvalidArgumentError: A batch size <= 0 or an empty list; an element with a
                scalar leaf.
        """
        from dataservice.data.batching_ops import RebatchDataset  # see "Modules"

        return RebatchDataset(self, batch_size, drop_remainder)

    def window(  # type: ignore[misc]
        self: Dataset,
        size: int,
        shift: int | None = None,
        stride: int = 1,
        drop_remainder: bool = False,
    ) -> Dataset:
        """Windows of input elements, each a nest of datasets (tf.data's dataset of
        windows): window k holds elements `k * shift + i * stride` for i < `size`.

        >>> from dataservice import Dataset
        >>> ds = Dataset.range(7).window(3, shift=2, drop_remainder=True)
        >>> [[int(x) for x in w] for w in ds]
        [[0, 1, 2], [2, 3, 4], [4, 5, 6]]
        >>> [b.tolist() for b in Dataset.range(5).window(2).flat_map(lambda w: w.batch(2))]
        [[0, 1], [2, 3], [4]]

        An element `(a, b)` gives a window `(dataset_of_a, dataset_of_b)`; `element_spec`
        leaves are `DatasetSpec`. A window is not a numpy value: flatten windows
        (`flat_map`) before a pipeline's end when the data service serves it.

        Args:
            size: Elements per window (> 0).
            shift: Input elements from one window's start to the next (> 0; None:
                `size`).
            stride: Input elements between two elements of a window (> 0).
            drop_remainder: Drop the windows smaller than `size` at the end.
        Raises:
            InvalidArgumentError: `size`, `shift` or `stride` <= 0.
        """
        from dataservice.data.batching_ops import WindowDataset  # see "Modules"

        return WindowDataset(self, size, shift, stride, drop_remainder)

    def bucket_by_sequence_length(  # type: ignore[misc]
        self: Dataset,
        element_length_func: Callable[..., int],
        bucket_boundaries: Sequence[int],
        bucket_batch_sizes: Sequence[int],
        padded_shapes: Any = None,
        padding_values: Any = None,
        pad_to_bucket_boundary: bool = False,
        no_padding: bool = False,
        drop_remainder: bool = False,
    ) -> Dataset:
        """Elements grouped by length into buckets, each batched and padded on its own.

        An element of length L (`element_length_func(element)`) goes to bucket i
        where `bucket_boundaries[i-1] <= L < bucket_boundaries[i]` (bucket 0 below
        the first boundary, the last at or above the last one). A bucket's batch of
        `bucket_batch_sizes[i]` comes out as soon as it is full; at the end, the
        partial batches come out in bucket order (none with `drop_remainder`).

        >>> import numpy as np
        >>> from dataservice import Dataset, TensorSpec
        >>> ds = Dataset.from_generator(lambda: ([1] * n for n in [1, 5, 2, 6, 3]),
        ...     output_signature=TensorSpec((None,), np.int64))
        >>> [b.shape for b in ds.bucket_by_sequence_length(len, [4], [2, 2])]
        [(2, 2), (2, 6), (1, 3)]

        Args:
            padded_shapes, padding_values: As `padded_batch`.
            pad_to_bucket_boundary: Pad the dimensions padded_shapes leaves open to
                the bucket's boundary - 1 instead of the batch's largest; every
                length must then be < the last boundary.
            no_padding: Batch without padding (elements of a batch must have the
                same shape).
        Raises:
            InvalidArgumentError: `bucket_boundaries` not increasing,
                `len(bucket_batch_sizes) != len(bucket_boundaries) + 1`, a batch size
                <= 0; while iterating, a length that is not an int, or one >= the last
                boundary with `pad_to_bucket_boundary`.
            TypeError: `element_length_func` is not callable.
        """
        from dataservice.data.batching_ops import BucketBySequenceLengthDataset  # see "Modules"

        return BucketBySequenceLengthDataset(
            self,
            element_length_func,
            bucket_boundaries,
            bucket_batch_sizes,
            padded_shapes,
            padding_values,
            pad_to_bucket_boundary,
            no_padding,
            drop_remainder,
        )

    def cache(self: Dataset, filename: str = "") -> Dataset:  # type: ignore[misc]
        """The elements of the first full pass, kept and produced again by later passes:
        in memory (`filename=""`, this `Dataset` object in this process) or in the file
        `<filename>.data`. A partial pass caches nothing; a second concurrent writer
        reads its input instead; under DYNAMIC sharding elements pass through
        uncached. cache_ops.py's docstring has the rules.

        >>> from dataservice import Dataset
        >>> ds = Dataset.range(3).cache()
        >>> [int(x) for x in ds], [int(x) for x in ds]
        ([0, 1, 2], [0, 1, 2])

        Raises:
            TypeError: `filename` is not a str.
            DataLossError: (while iterating) the cache file is damaged.
        """
        from dataservice.data.cache_ops import CacheDataset  # see "Modules"

        return CacheDataset(self, filename)

    def ignore_errors(self: Dataset, log_warning: bool = False) -> Dataset:  # type: ignore[misc]
        """The input's elements less those whose computation raised (a `map` function,
        a `filter` predicate, a `flat_map`/`interleave` function); each one skipped is
        counted in `iter(ds).stats()["errors_ignored"]` (through the data service: in
        the consumer's `stats()`, as the workers count them). An error no function
        raised (a source's) ends the input. error_ops.py's docstring has the rules.

        >>> from dataservice import Dataset
        >>> it = iter(Dataset.from_tensor_slices([1., 2., 0., 4.])
        ...     .map(lambda x: 1 / x if x else 1 // 0).ignore_errors())
        >>> [float(x) for x in it], it.stats()["errors_ignored"]
        ([1.0, 0.5, 0.25], 1)

        Args:
            log_warning: Log a WARNING for each element skipped.
        """
        from dataservice.data.error_ops import IgnoreErrorsDataset  # see "Modules"

        return IgnoreErrorsDataset(self, log_warning)

    @staticmethod
    def sample_from_datasets(
        datasets: Sequence[Dataset],
        weights: Sequence[float] | Dataset | None = None,
        seed: int | None = None,
        stop_on_empty_dataset: bool = False,
        rerandomize_each_iteration: bool | None = None,
    ) -> Dataset:
        """Elements drawn at random from `datasets`, input i with probability
        `weights[i]` (normalised). mixing_ops.py's docstring has DYNAMIC sharding and
        cardinality.

        >>> from dataservice import Dataset
        >>> ds = Dataset.sample_from_datasets(
        ...     [Dataset.range(0, 3), Dataset.range(100, 103)], seed=7)
        >>> sorted(int(x) for x in ds)
        [0, 1, 2, 100, 101, 102]

        Args:
            datasets: A non-empty list of Datasets with compatible element specs.
            weights: One weight >= 0 per dataset (None: uniform), or a Dataset whose
                elements are such lists (one draw per element; ends with it).
            seed: Makes the draws reproducible: the same seed, the same order.
            stop_on_empty_dataset: End at the first draw of an input that has ended;
                False (the default): draw among the inputs that have not ended, and end
                when none has.
            rerandomize_each_iteration: With a seed, True gives each epoch its own
                order (reproducible); False/None: every epoch has the same.
        Raises:
            TypeError: `datasets` is not a list of Datasets, or their specs differ.
            InvalidArgumentError: `datasets` is empty; `weights` does not have one
                finite weight >= 0 per dataset, or they are all 0.
        """
        from dataservice.data.mixing_ops import SampleFromDatasetsDataset  # see "Modules"

        return SampleFromDatasetsDataset(
            datasets, weights, seed, stop_on_empty_dataset, rerandomize_each_iteration
        )

    @staticmethod
    def choose_from_datasets(
        datasets: Sequence[Dataset], choice_dataset: Dataset, stop_on_empty_dataset: bool = True
    ) -> Dataset:
        """Element k is the next element of `datasets[c_k]`, `c_k` the k-th element of
        `choice_dataset` (int64 scalars).

        >>> from dataservice import Dataset
        >>> choice = Dataset.range(3).repeat(2)
        >>> ds = Dataset.choose_from_datasets(
        ...     [Dataset.from_tensors("a").repeat(), Dataset.from_tensors("b").repeat(),
        ...      Dataset.from_tensors("c").repeat()], choice)
        >>> "".join(str(x) for x in ds)
        'abcabc'

        Args:
            stop_on_empty_dataset: End when a chosen input has ended (default); False:
                skip that choice, and end when every input has ended.
        Raises:
            TypeError: `datasets` is not a list of Datasets or their specs differ;
                `choice_dataset` is not a Dataset of integer scalars.
            InvalidArgumentError: `datasets` is empty; while iterating, a choice that
                is not in [0, len(datasets)).
        """
        from dataservice.data.mixing_ops import ChooseFromDatasetsDataset  # see "Modules"

        return ChooseFromDatasetsDataset(datasets, choice_dataset, stop_on_empty_dataset)
