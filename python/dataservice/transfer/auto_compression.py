"""`compression="AUTO"` over gRPC (`AutoCompression`): whether a consumer asks a worker
for zstd, decided per link by measuring the link and the codec on the data, never by
host. Used by `transfer.grpc.GrpcTransferClient`, which re-exports it.
"""

from __future__ import annotations

import time
from typing import Any

from dataservice.transfer import base, codec


class AutoCompression:
    """`compression="AUTO"` over gRPC: whether to ask the worker for zstd, decided
    by measuring, per client (one worker's link), instead of by host. Compressing
    pays when the wire time it saves exceeds the codec's time:

        (1 - ratio) / link_bytes_per_s > 1 / compress_bytes_per_s + 1 / decompress_bytes_per_s

    `link_bytes_per_s` is measured on uncompressed replies of at least
    `MIN_MEASURED_BYTES` (a head's elements: from the head to their last byte);
    `ratio` and the codec's speeds on a `SAMPLE_BYTES` sample of a received
    element, compressed at the worker's level (`codec.ZSTD_LEVEL`) and decompressed here (the worker
    compresses at about the speed measured here, on the same data). So a link
    faster than the codec is never compressed, nor incompressible data (its
    ratio ~1, found on 64 KiB), and a slow link with compressible data is. Both
    are measured again every `REMEASURE_S` (while compressing, one request goes
    uncompressed to measure the link).

    That model only decides to try. What decides to go on is what each mode
    delivers: the bytes of elements (as before compression) per second from a
    request to its reply's last byte, over full replies (as many elements or
    bytes as asked for: not a reply that waited for the pipeline), measured for
    both modes within `2 * REMEASURE_S`. Compressing goes on only while it
    delivers more than not compressing: the model's codec speed is one sample's
    here, while the worker compresses whole replies before sending them, its
    CPU shared with its pipeline (on 2 cores, zero-filled 150 KB elements over
    loopback: ~0.6 GB/s compressed against ~1.2 GB/s not).
    Thread-compatible (one client's requests).
    """

    MIN_MEASURED_BYTES = 256 << 10
    SAMPLE_BYTES = 64 << 10
    REMEASURE_S = 5.0
    MAX_RATIO = 0.9  # less saved than this is not worth a codec

    def __init__(self) -> None:
        self.link_bytes_per_s: float | None = None
        self.ratio: float | None = None
        self.codec_s_per_byte: float | None = None  # compress + decompress
        self.compressing = False
        self._link_at = float("-inf")  # when the link was last measured
        self._sample_at = float("-inf")
        # What each mode delivered ("" and "zstd"): bytes of elements (as before
        # compression) per second of request, and when last measured.
        self.delivered: dict[str, float] = {}
        self._delivered_at: dict[str, float] = {}

    def choose(self, now: float) -> str:
        """The compression of the next request: "zstd" or ""."""
        if self.compressing and now - self._link_at < self.REMEASURE_S:
            return "zstd"
        return ""

    def observe(
        self,
        compression: str,
        received_bytes: int,
        payload_s: float,
        encoded: list[Any],
        wall_s: float = 0.0,
        asked: tuple[int, int] | None = None,
    ) -> None:
        """A reply asked for with `compression` brought `received_bytes` of elements
        (`encoded`) in `payload_s` seconds of transfer, `wall_s` seconds after its
        request went out asking for `asked` (max elements, max bytes): measures and
        decides."""
        now = time.monotonic()
        if wall_s > 0 and asked is not None and encoded:
            plain = sum(map(codec.plain_nbytes, encoded))
            if plain >= self.MIN_MEASURED_BYTES and base.reply_filled(len(encoded), plain, *asked):
                rate = plain / wall_s
                last = self.delivered.get(compression)
                fresh = now - self._delivered_at.get(compression, float("-inf")) < self.REMEASURE_S
                self.delivered[compression] = 0.5 * last + 0.5 * rate if last and fresh else rate
                self._delivered_at[compression] = now
        if compression:
            # Compressed bytes measure neither the link nor the data.
            self.compressing = self._worth_it()
            return
        if received_bytes >= self.MIN_MEASURED_BYTES and payload_s > 0:
            rate = received_bytes / payload_s
            if self.link_bytes_per_s is None or now - self._link_at > self.REMEASURE_S:
                self.link_bytes_per_s = rate
            else:  # smooth out one reply's hiccup
                self.link_bytes_per_s = 0.5 * self.link_bytes_per_s + 0.5 * rate
            self._link_at = now
        if encoded and now - self._sample_at >= self.REMEASURE_S:
            largest = max(encoded, key=len)
            if len(largest) >= 4 << 10:
                self._sample_at = now
                self._measure_codec(largest)
        self.compressing = self._worth_it()

    def _measure_codec(self, data: Any) -> None:
        import zstandard

        start = max(0, len(data) // 2 - self.SAMPLE_BYTES // 2)
        sample = bytes(memoryview(data)[start : start + self.SAMPLE_BYTES])
        t0 = time.perf_counter()
        packed = zstandard.ZstdCompressor(level=codec.ZSTD_LEVEL).compress(sample)
        zstandard.ZstdDecompressor().decompress(packed)
        self.ratio = len(packed) / len(sample)
        self.codec_s_per_byte = max(time.perf_counter() - t0, 1e-9) / len(sample)

    def _worth_it(self) -> bool:
        link, ratio, codec_cost = self.link_bytes_per_s, self.ratio, self.codec_s_per_byte
        if link is None or ratio is None or codec_cost is None or ratio > self.MAX_RATIO:
            return False
        if not (1 - ratio) / link > codec_cost:
            return False
        now = time.monotonic()
        at = self._delivered_at
        if all(now - at.get(mode, float("-inf")) < 2 * self.REMEASURE_S for mode in ("", "zstd")):
            return self.delivered["zstd"] > self.delivered[""]
        return True
