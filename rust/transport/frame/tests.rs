//! Unit tests of the element frame (`super`): the binary spec's round trip and its
//! truncations, DATA frames built by `FramePlan` and parsed back by `parse_leaves`, and
//! leaf lengths, shapes or VARBYTES offsets that disagree with the frame (an error, never
//! a panic or a slice outside the frame; a proptest damages descriptors at random). They
//! use only `super`'s items (and proptest).

use super::*;

#[test]
fn spec_round_trip() {
    let leaf = |k, d: &str, n, s| {
        Spec::Leaf(LeafSpec {
            kind: k,
            dtype: d.into(),
            ndim: n,
            itemsize: s,
        })
    };
    let spec = Spec::Dict(vec![
        ("a".into(), leaf(LeafKind::Array, "<f4", 3, 4)),
        (
            "b".into(),
            Spec::NamedTuple {
                module: "m".into(),
                name: "P".into(),
                fields: vec!["x".into(), "y".into()],
                items: vec![
                    leaf(LeafKind::Scalar, "<i8", 0, 8),
                    Spec::List(vec![leaf(LeafKind::Bytes, "", 0, 0)]),
                ],
            },
        ),
    ]);
    let mut buf = Vec::new();
    spec.encode(&mut buf);
    assert_eq!(Spec::decode(&buf).unwrap(), spec);
    assert_eq!(spec.leaves().len(), 3);
    for cut in 0..buf.len() {
        assert!(Spec::decode(&buf[..cut]).is_err());
    }
}

/// A DATA frame of an `[n, 3]` u16 array and `items` as a VARBYTES leaf, its specs.
fn two_leaf_frame(n: u64, items: &[&[u8]]) -> (Vec<u8>, [LeafSpec; 2]) {
    let array: Vec<u8> = (0..n * 6).map(|i| i as u8).collect();
    let leaves = vec![
        LeafIn {
            kind: LeafKind::Array,
            itemsize: 2,
            dims: vec![n, 3].into(),
            payload: Payload::Owned(array),
        },
        LeafIn {
            kind: LeafKind::VarBytes,
            itemsize: 0,
            dims: vec![items.len() as u64].into(),
            payload: Payload::Owned(varbytes_payload(items)),
        },
    ];
    let plan = FramePlan::data(1, leaves);
    let mut buf = vec![0u8; plan.total_bytes as usize];
    // SAFETY: buf holds total_bytes bytes and is distinct from the payloads.
    unsafe { plan.copy_range(0, plan.total_bytes, buf.as_mut_ptr()) };
    let specs = [
        LeafSpec {
            kind: LeafKind::Array,
            dtype: "<u2".into(),
            ndim: 2,
            itemsize: 2,
        },
        LeafSpec {
            kind: LeafKind::VarBytes,
            dtype: "".into(),
            ndim: 1,
            itemsize: 0,
        },
    ];
    (buf, specs)
}

/// Byte offsets in the frame of leaf 0's nbytes and dims[0], and leaf 1's dims[0].
const LEAF0_NBYTES: usize = HEADER_BYTES + 16;
const LEAF0_DIM0: usize = HEADER_BYTES + 24;
const LEAF1_DIM0: usize = HEADER_BYTES + 24 + 16 + 24;

fn parse(buf: &[u8], specs: &[LeafSpec; 2]) -> Result<Vec<LeafDesc>, Error> {
    let header = FrameHeader::parse(buf)?;
    parse_leaves(buf, &header, &[&specs[0], &specs[1]], 0)
}

#[test]
fn leaf_lengths_that_disagree_or_overrun_are_corrupt() {
    let (good, specs) = two_leaf_frame(10, &[b"ab", b"", b"cde"]);
    let descs = parse(&good, &specs).unwrap();
    assert_eq!(descs[0].nbytes, 60);
    let payload = &good[descs[1].offset as usize..][..descs[1].nbytes as usize];
    assert_eq!(
        varbytes_items(payload, 3, 0).unwrap(),
        vec![&b"ab"[..], b"", b"cde"]
    );
    let patch = |at: usize, value: u64| {
        let mut bad = good.clone();
        bad[at..at + 8].copy_from_slice(&value.to_le_bytes());
        parse(&bad, &specs)
    };
    // nbytes that disagrees with shape x itemsize, however big.
    for nbytes in [59, 61, u64::MAX, 1 << 40] {
        assert!(patch(LEAF0_NBYTES, nbytes).is_err(), "nbytes {nbytes}");
    }
    // A shape whose item count overflows, or (with a matching nbytes) runs past the frame.
    assert!(patch(LEAF0_DIM0, u64::MAX).is_err());
    let mut bad = good.clone();
    bad[LEAF0_DIM0..LEAF0_DIM0 + 8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    bad[LEAF0_NBYTES..LEAF0_NBYTES + 8].copy_from_slice(&(6u64 << 40).to_le_bytes());
    assert!(parse(&bad, &specs).is_err());
    // A VARBYTES item count whose offsets table would not fit its payload.
    for n in [4, 1 << 20, u64::MAX / 8, u64::MAX] {
        assert!(patch(LEAF1_DIM0, n).is_err(), "varbytes count {n}");
    }
    // Offsets inside the payload that point past it or go backwards.
    let off = descs[1].offset as usize;
    for (slot, value) in [(1usize, 1u64 << 50), (3, 1)] {
        let mut bad = good.clone();
        bad[off + 8 * slot..off + 8 * slot + 8].copy_from_slice(&value.to_le_bytes());
        let payload = &bad[off..off + descs[1].nbytes as usize];
        assert!(varbytes_items(payload, 3, 0).is_err(), "offset {slot}");
    }
}

proptest::proptest! {
    #[test]
    fn any_damage_to_leaf_descriptors_is_an_error_or_in_bounds(
        flips in proptest::collection::vec((0usize..96, proptest::num::u8::ANY), 1..8)
    ) {
        let (mut buf, specs) = two_leaf_frame(10, &[b"ab", b"", b"cde"]);
        for (at, byte) in flips {
            buf[HEADER_BYTES + at] = byte;
        }
        // Never a panic or an allocation sized by the damage: an error, or leaves
        // that lie inside the frame with consistent sizes.
        if let Ok(descs) = parse(&buf, &specs) {
            for d in &descs {
                proptest::prop_assert!(d.offset + d.nbytes <= buf.len() as u64);
            }
            let items: u64 = descs[0].dims.iter().product();
            proptest::prop_assert_eq!(items * 2, descs[0].nbytes);
            let d = &descs[1];
            let payload = &buf[d.offset as usize..][..d.nbytes as usize];
            let _ = varbytes_items(payload, d.dims[0] as usize, 0);
        }
    }
}

#[test]
fn data_frame_round_trip() {
    let data = vec![7u8; 100_000];
    let leaves = vec![
        LeafIn {
            kind: LeafKind::Array,
            itemsize: 1,
            dims: vec![100_000].into(),
            payload: Payload::Borrowed(&data),
        },
        LeafIn {
            kind: LeafKind::PyInt,
            itemsize: 0,
            dims: vec![].into(),
            payload: Payload::Owned(5i64.to_le_bytes().to_vec()),
        },
    ];
    let plan = FramePlan::data(3, leaves);
    assert!(plan.page_align);
    let mut buf = vec![0u8; plan.total_bytes as usize];
    // SAFETY: buf holds total_bytes bytes and is distinct from the payloads.
    unsafe { plan.copy_range(0, plan.total_bytes, buf.as_mut_ptr()) };
    let h = FrameHeader::parse(&buf).unwrap();
    assert_eq!(h.total_bytes, plan.total_bytes);
    let s1 = LeafSpec {
        kind: LeafKind::Array,
        dtype: "|u1".into(),
        ndim: 1,
        itemsize: 1,
    };
    let s2 = LeafSpec {
        kind: LeafKind::PyInt,
        dtype: "".into(),
        ndim: 0,
        itemsize: 0,
    };
    let descs = parse_leaves(&buf, &h, &[&s1, &s2], 0).unwrap();
    assert_eq!(descs[0].offset % LEASE_ALIGN, 0);
    let a = &buf[descs[0].offset as usize..][..100_000];
    assert!(a.iter().all(|&b| b == 7));
    // Chunked copy gives the same bytes.
    let mut buf2 = vec![0u8; plan.total_bytes as usize];
    let mut at = 0;
    while at < plan.total_bytes {
        let to = (at + 4093).min(plan.total_bytes);
        // SAFETY: the slice from `at` holds at least to - at bytes.
        unsafe { plan.copy_range(at, to, buf2.as_mut_ptr().add(at as usize)) };
        at = to;
    }
    assert_eq!(buf, buf2);
}

#[test]
fn self_contained_element_round_trip_and_damage() {
    let spec = Spec::Tuple(vec![Spec::Leaf(LeafSpec {
        kind: LeafKind::Array,
        dtype: "<f4".into(),
        ndim: 1,
        itemsize: 4,
    })]);
    let mut spec_bytes = Vec::new();
    spec.encode(&mut spec_bytes);
    let payload = [1u8, 2, 3, 4, 5, 6, 7, 8];
    let plan = FramePlan::data(
        0,
        vec![LeafIn {
            kind: LeafKind::Array,
            itemsize: 4,
            dims: vec![2].into(),
            payload: Payload::Borrowed(&payload),
        }],
    );
    let mut buf = element_prefix(&spec_bytes);
    assert_eq!(buf.len() % 64, 0);
    let start = buf.len();
    buf.resize(start + plan.total_bytes as usize, 0xAA);
    // SAFETY: the destination holds total_bytes bytes of our own Vec.
    unsafe { plan.copy_range(0, plan.total_bytes, buf.as_mut_ptr().add(start)) };

    let (got_spec, frame_start) = split_element(&buf).unwrap();
    assert_eq!(frame_start, start);
    assert_eq!(Spec::decode(got_spec).unwrap(), spec);
    let frame = &buf[frame_start..];
    let header = FrameHeader::parse(frame).unwrap();
    let leaves = spec.leaves();
    let descs = parse_leaves(frame, &header, &leaves, frame_start as u64).unwrap();
    let d = &descs[0];
    assert_eq!(
        &frame[d.offset as usize..(d.offset + d.nbytes) as usize],
        &payload
    );

    let err = |b: &[u8]| split_element(b).unwrap_err().to_string();
    assert!(err(b"DSE1\0\0\0\0").contains("bad magic"));
    assert!(err(&buf[..6]).contains("bad magic"));
    let mut long_spec = buf.clone();
    long_spec[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(err(&long_spec).contains("runs past the end"));
    assert!(err(&buf[..start + 16]).contains("truncated"));
    assert!(err(&buf[..buf.len() - 64]).contains("declares"));
    let mut not_data = buf.clone();
    not_data[start] = KIND_END as u8;
    assert!(err(&not_data).contains("is not DATA"));
    let mut extra = buf.clone();
    extra.extend_from_slice(&[0; 64]);
    assert!(err(&extra).contains("declares"));
}

#[test]
fn dims_hold_few_inline_and_many_on_the_heap() {
    for n in 0..10u64 {
        let mut d = Dims::default();
        for i in 0..n {
            d.push(i * 3);
        }
        assert_eq!(&*d, &(0..n).map(|i| i * 3).collect::<Vec<_>>()[..]);
    }
}

#[test]
fn packed_frames_keep_large_payloads_64_byte_aligned() {
    let big = vec![7u8; 100_000];
    let leaf = |p: &'static [u8]| LeafIn {
        kind: LeafKind::Array,
        itemsize: 1,
        dims: vec![p.len() as u64].into(),
        payload: Payload::Borrowed(p),
    };
    let big: &'static [u8] = Box::leak(big.into_boxed_slice());
    let paged = FramePlan::data(0, vec![leaf(big)]);
    let packed = FramePlan::data_aligned(0, vec![leaf(big)], false);
    assert!(paged.page_align && !packed.page_align);
    assert_eq!(paged.payloads[0].0 % LEASE_ALIGN, 0);
    assert_eq!(packed.payloads[0].0, 64);
    assert_eq!(packed.total_bytes, (64 + 100_000u64).next_multiple_of(64));
}
