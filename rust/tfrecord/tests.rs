//! Unit tests of the TFRecord reader and writer (`super`): framing round trips, CRC
//! and length damage, compression (GZIP, ZLIB) and its parsing. They use only
//! `super`'s items and temporary files they remove.

use super::*;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh path under the temp dir, removed on drop.
struct TempPath(PathBuf);

impl TempPath {
    fn new(name: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir();
        TempPath(dir.join(format!("tfrecord-{}-{n}-{name}", std::process::id())))
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn write_records(path: &Path, compression: Compression, records: &[Vec<u8>]) {
    let mut writer = RecordWriter::create(path, compression).unwrap();
    for record in records {
        writer.write(record).unwrap();
    }
    writer.close().unwrap();
}

fn sample_records() -> Vec<Vec<u8>> {
    vec![
        Vec::new(),
        b"a".to_vec(),
        b"hello tfrecord".to_vec(),
        (0..70_000u32).map(|i| (i * 7 % 251) as u8).collect(),
        Vec::new(),
    ]
}

#[test]
fn crc32c_check_value() {
    // The standard CRC-32C check value, and iSCSI test vectors (RFC 3720 B.4).
    assert_eq!(crc32c(b"123456789"), 0xe306_9283);
    assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
    assert_eq!(crc32c(&[0xffu8; 32]), 0x62a8_ab43);
    assert_eq!(crc32c(b""), 0);
}

#[test]
fn mask_round_trips_and_differs() {
    for crc in [0u32, 1, 0xdead_beef, u32::MAX, crc32c(b"foo")] {
        assert_eq!(unmask(mask(crc)), crc);
        assert_ne!(mask(crc), crc);
        assert_ne!(mask(mask(crc)), crc);
    }
    assert_eq!(masked_crc32c(b""), MASK_DELTA);
}

#[test]
fn framing_of_a_tiny_record() {
    let path = TempPath::new("tiny.tfrecord");
    write_records(&path.0, Compression::None, &[b"abc".to_vec()]);
    let bytes = std::fs::read(&path.0).unwrap();
    let mut expected = Vec::new();
    expected.extend_from_slice(&3u64.to_le_bytes());
    expected.extend_from_slice(&masked_crc32c(&3u64.to_le_bytes()).to_le_bytes());
    expected.extend_from_slice(b"abc");
    expected.extend_from_slice(&masked_crc32c(b"abc").to_le_bytes());
    assert_eq!(bytes, expected);
}

#[test]
fn round_trip_every_compression() {
    for compression in [Compression::None, Compression::Gzip, Compression::Zlib] {
        let path = TempPath::new("round-trip.tfrecord");
        let records = sample_records();
        write_records(&path.0, compression, &records);
        assert_eq!(read_file(&path.0, compression).unwrap(), records);
        let mut reader = RecordReader::open(&path.0, compression, 0).unwrap();
        while reader.next_record().unwrap().is_some() {}
        let total: usize = records.iter().map(|r| r.len() + 16).sum();
        assert_eq!(reader.offset(), total as u64, "{compression:?}");
    }
}

#[test]
fn empty_file_has_no_records() {
    for compression in [Compression::None, Compression::Gzip, Compression::Zlib] {
        let path = TempPath::new("empty.tfrecord");
        write_records(&path.0, compression, &[]);
        assert!(read_file(&path.0, compression).unwrap().is_empty());
    }
    let path = TempPath::new("zero-bytes.tfrecord");
    std::fs::write(&path.0, b"").unwrap();
    assert!(read_file(&path.0, Compression::None).unwrap().is_empty());
}

#[test]
fn flush_makes_records_readable_while_open() {
    for compression in [Compression::None, Compression::Gzip, Compression::Zlib] {
        let path = TempPath::new("flush.tfrecord");
        let mut writer = RecordWriter::create(&path.0, compression).unwrap();
        writer.write(b"one").unwrap();
        writer.sync().unwrap();
        let mut reader = RecordReader::open(&path.0, compression, 0).unwrap();
        assert_eq!(reader.next_record().unwrap().unwrap(), b"one");
        // The stream is unfinished, yet ends cleanly after the flushed record.
        assert!(reader.next_record().unwrap().is_none());
        writer.close().unwrap();
        writer.close().unwrap();
        assert!(matches!(writer.write(b"x"), Err(Error::Closed { .. })));
    }
}

#[test]
fn damaged_data_length_and_tail() {
    let path = TempPath::new("damaged.tfrecord");
    let records = sample_records();
    write_records(&path.0, Compression::None, &records);
    let good = std::fs::read(&path.0).unwrap();
    // Record 2 ("hello tfrecord") starts after records 0 and 1.
    let third = (16 + 17) as u64;

    let mut bytes = good.clone();
    bytes[third as usize + HEADER_BYTES + 3] ^= 0x10;
    std::fs::write(&path.0, &bytes).unwrap();
    let mut reader = RecordReader::open(&path.0, Compression::None, 0).unwrap();
    assert!(reader.next_record().unwrap().is_some());
    assert!(reader.next_record().unwrap().is_some());
    let error = reader.next_record().unwrap_err();
    match &error {
        Error::CorruptedRecord { offset, what, .. } => {
            assert_eq!(*offset, third);
            assert_eq!(what, "data CRC mismatch");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(error.to_string().contains(&path.0.display().to_string()));
    // The failure sticks.
    assert!(matches!(
        reader.next_record(),
        Err(Error::CorruptedRecord { .. })
    ));

    let mut bytes = good.clone();
    bytes[third as usize + 1] ^= 0x01;
    std::fs::write(&path.0, &bytes).unwrap();
    let mut reader = RecordReader::open(&path.0, Compression::None, 0).unwrap();
    reader.next_record().unwrap();
    reader.next_record().unwrap();
    match reader.next_record() {
        Err(Error::CorruptedRecord { offset, what, .. }) => {
            assert_eq!(offset, third);
            assert_eq!(what, "length CRC mismatch");
        }
        other => panic!("unexpected {other:?}"),
    }

    // The last record is empty (16 bytes): cut one byte of its footer, all of its
    // footer, and all but 5 bytes of its header.
    for cut in [1, 4, 11] {
        std::fs::write(&path.0, &good[..good.len() - cut]).unwrap();
        let mut reader = RecordReader::open(&path.0, Compression::None, 0).unwrap();
        for _ in 0..records.len() - 1 {
            reader.next_record().unwrap().unwrap();
        }
        assert!(
            matches!(reader.next_record(), Err(Error::TruncatedRecord { .. })),
            "cut {cut}"
        );
    }
}

#[test]
fn truncated_compressed_streams_are_data_loss() {
    for compression in [Compression::Gzip, Compression::Zlib] {
        let path = TempPath::new("cut.tfrecord.z");
        write_records(&path.0, compression, &sample_records());
        let good = std::fs::read(&path.0).unwrap();
        // Cut inside the 70000-byte record.
        std::fs::write(&path.0, &good[..good.len() / 2]).unwrap();
        let error = read_file(&path.0, compression).unwrap_err();
        assert!(
            matches!(error, Error::TruncatedRecord { offset: 63, .. }),
            "{compression:?}: {error:?}"
        );
        let mut bytes = good.clone();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0xff;
        bytes[middle + 1] ^= 0xff;
        std::fs::write(&path.0, &bytes).unwrap();
        let error = read_file(&path.0, compression).unwrap_err();
        assert!(error.is_data_loss(), "{compression:?} flipped: {error:?}");
    }
}

/// A stream holding one header that declares `declared` bytes, then `data`.
fn header_claiming(declared: u64, data: &[u8]) -> Vec<u8> {
    let mut bytes = encode_header(declared).to_vec();
    bytes.extend_from_slice(data);
    bytes
}

fn compress(compression: Compression, raw: &[u8]) -> Vec<u8> {
    let level = flate2::Compression::default();
    match compression {
        Compression::Gzip => {
            let mut e = GzEncoder::new(Vec::new(), level);
            e.write_all(raw).unwrap();
            e.finish().unwrap()
        }
        Compression::Zlib => {
            let mut e = ZlibEncoder::new(Vec::new(), level);
            e.write_all(raw).unwrap();
            e.finish().unwrap()
        }
        Compression::None => raw.to_vec(),
    }
}

#[test]
fn huge_declared_length_is_truncation_not_an_allocation() {
    // A few dozen bytes whose header claims 1 GiB (and, for the last, ~isize::MAX): the
    // reader reports truncation at offset 0, having allocated at most twice what the
    // stream held (a 1 GiB zeroed buffer before would show in the peak RSS; the
    // isize::MAX claim would have failed its allocation or been OOM-killed).
    for declared in [1u64 << 30, MAX_RECORD_BYTES] {
        for compression in [Compression::None, Compression::Gzip, Compression::Zlib] {
            let path = TempPath::new("claims-1gib.tfrecord");
            let bytes = compress(compression, &header_claiming(declared, b"tiny"));
            assert!(bytes.len() < 64, "{compression:?}: {} bytes", bytes.len());
            std::fs::write(&path.0, &bytes).unwrap();
            let mut reader = RecordReader::open(&path.0, compression, 0).unwrap();
            let error = reader.next_record().unwrap_err();
            match &error {
                Error::TruncatedRecord { offset, what, .. } => {
                    assert_eq!(*offset, 0, "{compression:?}");
                    assert!(what.contains(&declared.to_string()), "{what}");
                }
                other => panic!("{compression:?}: unexpected {other:?}"),
            }
            assert!(error.to_string().contains(&path.0.display().to_string()));
            assert!(error.is_data_loss());
        }
    }
}

#[test]
fn incremental_body_reads_big_records_exactly() {
    // Records around the doubling steps of a 64 KiB first piece (64 KiB, 128 KiB ...)
    // read back intact through the growing path, and a stream cut inside one is
    // truncation at its offset.
    let records: Vec<Vec<u8>> = [0usize, 1, 65_535, 65_536, 65_537, 300_000]
        .iter()
        .map(|&n| (0..n).map(|i| (i * 31 % 253) as u8).collect())
        .collect();
    let read_growing = |path: &Path, compression| -> Result<Vec<Vec<u8>>, Error> {
        let mut reader = RecordReader::open(path, compression, 0)?;
        let mut out = Vec::new();
        while reader.read_header()?.is_some() {
            out.push(reader.read_body_growing(64 * 1024)?);
        }
        Ok(out)
    };
    for compression in [Compression::Gzip, Compression::Zlib] {
        let path = TempPath::new("incremental.tfrecord.z");
        write_records(&path.0, compression, &records);
        assert_eq!(read_growing(&path.0, compression).unwrap(), records);
        assert_eq!(read_file(&path.0, compression).unwrap(), records);
        let reader = RecordReader::open(&path.0, compression, 0).unwrap();
        assert!(reader.may_allocate_declared_length(UNTRUSTED_LENGTH_BYTES));
        assert!(!reader.may_allocate_declared_length(UNTRUSTED_LENGTH_BYTES + 1));
        drop(reader);
        let mut raw = Vec::new();
        for record in &records {
            raw.extend_from_slice(&encode_header(record.len() as u64));
            raw.extend_from_slice(record);
            raw.extend_from_slice(&masked_crc32c(record).to_le_bytes());
        }
        let start_of_last = raw.len() - (HEADER_BYTES + 300_000 + FOOTER_BYTES);
        let cut = compress(compression, &raw[..start_of_last + HEADER_BYTES + 200_000]);
        std::fs::write(&path.0, cut).unwrap();
        match read_growing(&path.0, compression) {
            Err(Error::TruncatedRecord { offset, what, .. }) => {
                assert_eq!(offset, start_of_last as u64);
                assert!(what.contains("after 200000 of the 300000"), "{what}");
            }
            other => panic!("{compression:?}: unexpected {other:?}"),
        }
    }
    // An uncompressed file's lengths were checked against its size: any may be allocated.
    let path = TempPath::new("plain.tfrecord");
    write_records(&path.0, Compression::None, &records);
    let reader = RecordReader::open(&path.0, Compression::None, 0).unwrap();
    assert!(reader.may_allocate_declared_length(usize::MAX));
}

#[test]
fn record_above_the_trusted_length_reads_through_the_growing_path() {
    // 40 MiB of zeros: past 16 MiB (first piece) and 32 MiB (one doubling).
    let records = vec![vec![0u8; 40 << 20], b"after".to_vec()];
    for compression in [Compression::Gzip, Compression::Zlib] {
        let path = TempPath::new("forty-mib.tfrecord.z");
        write_records(&path.0, compression, &records);
        assert_eq!(read_file(&path.0, compression).unwrap(), records);
    }
}

#[test]
fn concatenated_gzip_members() {
    let first = TempPath::new("a.gz");
    let second = TempPath::new("b.gz");
    write_records(&first.0, Compression::Gzip, &[b"one".to_vec()]);
    write_records(&second.0, Compression::Gzip, &[b"two".to_vec()]);
    let mut bytes = std::fs::read(&first.0).unwrap();
    bytes.extend(std::fs::read(&second.0).unwrap());
    std::fs::write(&first.0, bytes).unwrap();
    let records = read_file(&first.0, Compression::Gzip).unwrap();
    assert_eq!(records, vec![b"one".to_vec(), b"two".to_vec()]);
}

#[test]
fn missing_file_and_bad_compression() {
    let path = TempPath::new("missing.tfrecord");
    match RecordReader::open(&path.0, Compression::None, 0) {
        Err(Error::NotFound { path: p }) => assert_eq!(p, path.0.display().to_string()),
        Err(other) => panic!("unexpected {other:?}"),
        Ok(_) => panic!("opened a missing file"),
    }
    assert!(matches!(
        Compression::parse(Some("gzip")),
        Err(Error::UnknownCompression(_))
    ));
    assert_eq!(Compression::parse(Some("")).unwrap(), Compression::None);
    assert_eq!(Compression::parse(None).unwrap(), Compression::None);
}
