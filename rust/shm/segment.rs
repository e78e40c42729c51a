//! The shared-memory object of the ring and of the cross-trainer cache window
//! (TRANSPORT.md §3): a sealed, pre-faulted memfd, and its mappings.
//!
//! `memfd_create` (no name in /dev/shm, so a crash at any instant leaks nothing: the pages
//! go with the last fd and mapping), sized once and sealed SHRINK|GROW|SEAL so no one can
//! truncate it under a mapping. Its memory is allocated (`fallocate`, so a full tmpfs or
//! memory cgroup gives ENOSPC/ENOMEM instead of SIGBUS on a later write) either whole at
//! creation (the window) or, for a ring, a first part at creation and the rest as the
//! producer's first lap reaches it ([`Segment::reserve`]): allocating is zeroing, ~1 ms per
//! MiB on a small VM, and a consumer that connects to 8 workers on one host would otherwise
//! wait for 16 x 64 MiB of it (rings and spare rings) before its first element.

use std::marker::PhantomData;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rustix::fs::{FallocateFlags, MemfdFlags, SealFlags};
use rustix::mm::{Advice, MapFlags, MprotectFlags, MremapFlags, ProtFlags};

use crate::error::Error;
use crate::shm::holds::LeafMapping;
use crate::shm::layout::{self, RingHeader};
use crate::shm::ring::Region;

#[cfg(target_endian = "big")]
compile_error!("the shared-memory ring format is little-endian only");

const _: () = assert!(cfg!(target_has_atomic = "64"));

/// Size of the header page (the data area starts page-aligned).
pub fn page_bytes() -> u64 {
    rustix::param::page_size() as u64
}

/// What a segment's header page holds and how it is checked: the ring's
/// ([`RingHeader`]) or the cache window's (`shm::window::WindowHeader`).
///
/// # Safety
/// `Self` must be `#[repr(C)]`, fit in 4096 bytes with an alignment of at most 4096, and be
/// valid to reference once [`SegmentHeader::init`] ran (or [`SegmentHeader::check`]
/// accepted the constants); after that only its atomics may change.
pub unsafe trait SegmentHeader: Sized {
    /// The memfd's name (shown in /proc/PID/fd; nothing is created in /dev/shm).
    const MEMFD_NAME: &'static str;
    /// What messages call the segment ("ring", "window").
    const WHAT: &'static str;
    /// What I/O errors name as the path.
    const IO_PATH: &'static str;
    /// False if peers map the data area read-only (they write only the header page).
    const PEER_WRITES_DATA: bool;

    fn valid_capacity(capacity_bytes: u64) -> bool;

    /// Writes a fresh header for a segment of `capacity_bytes`.
    ///
    /// # Safety
    /// `ptr` is page-aligned, writeable for `header_bytes`, and no one else sees it yet.
    unsafe fn init(ptr: *mut u8, header_bytes: u64, capacity_bytes: u64, nonce: [u8; 16]);

    /// Checks a received header page of `page` bytes against the segment's `size_bytes`;
    /// returns (capacity_bytes, nonce).
    ///
    /// # Safety
    /// `ptr` is a readable, page-aligned mapping of at least `page` bytes.
    unsafe fn check(ptr: *const u8, page: u64, size_bytes: u64) -> Result<(u64, [u8; 16]), Error>;
}

/// One mapping of a segment's memfd: header page + data area. Unmapped on drop. The one
/// mmap-owning type of both the ring (`Segment<RingHeader>`) and the cross-trainer cache
/// window (`Segment<WindowHeader>`).
pub struct Segment<H: SegmentHeader> {
    ptr: *mut u8,
    len: usize,
    header_bytes: u64,
    capacity: u64,
    /// Data-area bytes allocated from the start (`capacity` for a peer's mapping, which
    /// never grows the segment); only the creator's writer raises it (`reserve`).
    reserved: AtomicU64,
    fd: Arc<OwnedFd>,
    _header: PhantomData<fn() -> H>,
}

/// The ring's segment.
pub type Mapping = Segment<RingHeader>;

// SAFETY: the mapping is plain shared memory; concurrent access is governed by the ring's
// or the window's protocol (atomics in the header, byte ranges owned by one side at a time).
unsafe impl<H: SegmentHeader> Send for Segment<H> {}
// SAFETY: as above.
unsafe impl<H: SegmentHeader> Sync for Segment<H> {}

impl<H: SegmentHeader> Drop for Segment<H> {
    fn drop(&mut self) {
        // SAFETY: ptr/len is the range mmap returned to us and nobody else unmaps it; the
        // last Arc<Segment> (held by leases too) is gone, so no view points into it.
        unsafe {
            let _ = rustix::mm::munmap(self.ptr.cast(), self.len);
        }
    }
}

fn os_error<H: SegmentHeader>(op: &'static str, err: rustix::io::Errno) -> Error {
    Error::Io {
        op,
        path: H::IO_PATH.to_string(),
        source: err.into(),
    }
}

impl<H: SegmentHeader> Segment<H> {
    /// Maps the whole segment. The creator's mapping of a wholly allocated segment is
    /// pre-faulted (`MAP_POPULATE`: it writes from the start; of a partly allocated one,
    /// `MAP_POPULATE` would allocate the rest: `reserve` pre-faults each part instead); a
    /// peer's mapping is not: its pages exist already (fallocate), so a first read of one
    /// is a minor fault, and mapping a 64 MiB ring takes 0.1 ms instead of ~13 ms, which a
    /// handshake waits for. A peer that writes only the header page
    /// (`!H::PEER_WRITES_DATA`) maps the data area read-only. `reserved` is the data bytes
    /// allocated (`capacity` for a peer).
    fn map(
        fd: Arc<OwnedFd>,
        header_bytes: u64,
        capacity: u64,
        creator: bool,
        reserved: u64,
    ) -> Result<Self, Error> {
        let len = (header_bytes + capacity) as usize;
        let writes_all = creator || H::PEER_WRITES_DATA;
        let prot = if writes_all {
            ProtFlags::READ | ProtFlags::WRITE
        } else {
            ProtFlags::READ
        };
        let flags = if creator && reserved == capacity {
            MapFlags::SHARED | MapFlags::POPULATE
        } else {
            MapFlags::SHARED
        };
        // SAFETY: a fresh shared mapping of a sealed, fully allocated memfd at an address
        // the kernel picks; nothing aliases it yet.
        let ptr =
            unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, prot, flags, fd.as_fd(), 0) }
                .map_err(|e| os_error::<H>("mapping", e))?;
        if !writes_all {
            // SAFETY: the first header_bytes of our own fresh mapping (page-aligned, inside
            // it): the header page is all such a peer stores into.
            let r = unsafe {
                rustix::mm::mprotect(
                    ptr,
                    header_bytes as usize,
                    MprotectFlags::READ | MprotectFlags::WRITE,
                )
            };
            if let Err(e) = r {
                // SAFETY: our own mapping of len bytes, not handed out yet.
                unsafe {
                    let _ = rustix::mm::munmap(ptr, len);
                }
                return Err(os_error::<H>("mapping", e));
            }
        }
        Ok(Segment {
            ptr: ptr.cast(),
            len,
            header_bytes,
            capacity,
            reserved: AtomicU64::new(reserved),
            fd,
            _header: PhantomData,
        })
    }

    /// A new sealed, pre-faulted memfd segment of `capacity_bytes`, all of it allocated,
    /// with a fresh header; the creator's (producer's, worker's) side.
    ///
    /// Raises `InvalidRingSize` for an unsupported size and `ShmExhausted` when the memory
    /// cannot be reserved (full tmpfs, memory cgroup).
    pub fn create(capacity_bytes: u64, nonce: [u8; 16]) -> Result<Arc<Self>, Error> {
        Self::create_reserving(capacity_bytes, nonce, capacity_bytes)
    }

    /// As [`Segment::create`], with only the first `reserve_bytes` of the data area
    /// allocated (rounded up to a page, at most `capacity_bytes`); its writer allocates
    /// the rest with [`Segment::reserve`] before it writes there. The whole size is still
    /// checked against the memory cgroup's free bytes now.
    pub fn create_reserving(
        capacity_bytes: u64,
        nonce: [u8; 16],
        reserve_bytes: u64,
    ) -> Result<Arc<Self>, Error> {
        if !H::valid_capacity(capacity_bytes) {
            return Err(Error::InvalidRingSize { capacity_bytes });
        }
        let header_bytes = page_bytes().max(4096);
        let total = header_bytes + capacity_bytes;
        let reserved = reserve_bytes
            .next_multiple_of(page_bytes())
            .min(capacity_bytes);
        let fd = rustix::fs::memfd_create(
            H::MEMFD_NAME,
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(|e| os_error::<H>("creating", e))?;
        // A memory cgroup at its limit answers fallocate on shmem with its OOM killer, not
        // ENOMEM: refuse up front what the cgroup cannot hold.
        check_cgroup(total)?;
        rustix::fs::ftruncate(&fd, total).map_err(|e| os_error::<H>("sizing", e))?;
        allocate(&fd, 0, header_bytes + reserved)?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(|e| os_error::<H>("sealing", e))?;
        let map = Segment::<H>::map(Arc::new(fd), header_bytes, capacity_bytes, true, reserved)?;
        if reserved < capacity_bytes {
            map.prefault(0, reserved);
        }
        // SAFETY: the mapping starts page-aligned with a whole header page, and no other
        // process has the fd yet.
        unsafe { H::init(map.ptr, header_bytes, capacity_bytes, nonce) };
        Ok(Arc::new(map))
    }

    /// Data-area bytes allocated so far, from the start.
    pub fn reserved_bytes(&self) -> u64 {
        self.reserved.load(Ordering::Relaxed)
    }

    /// Allocates (and pre-faults in this mapping) the data area up to at least `end`
    /// bytes: twice what is allocated, or `end` if more, rounded up to 1 MiB, at most the
    /// capacity, so a ring's first lap allocates in a few steps. The creator's writer
    /// calls it before it writes past [`Segment::reserved_bytes`]; a no-op below it.
    ///
    /// Raises `ShmExhausted` when the memory cannot be allocated (full tmpfs, or more
    /// than the memory cgroup has free: its OOM killer would answer the fallocate).
    pub fn reserve(&self, end: u64) -> Result<(), Error> {
        let have = self.reserved.load(Ordering::Relaxed);
        if end <= have {
            return Ok(());
        }
        let want = end
            .max(2 * have)
            .next_multiple_of(RESERVE_STEP_BYTES)
            .min(self.capacity);
        check_cgroup(want - have)?;
        allocate(&self.fd, self.header_bytes + have, want - have)?;
        self.prefault(have, want - have);
        self.reserved.fetch_max(want, Ordering::Relaxed);
        Ok(())
    }

    /// Maps data bytes `[offset, offset + len)` of this mapping to their (allocated)
    /// pages now (`MADV_POPULATE_WRITE`), so the writer's copies into them take no page
    /// faults; best effort (before Linux 5.14, or for a read-only mapping, they fault on
    /// first touch instead).
    fn prefault(&self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        // SAFETY: [offset, offset + len) lies inside our data area (callers pass allocated
        // parts of it); MADV_POPULATE_WRITE only faults pages in, it changes no contents.
        unsafe {
            let _ = rustix::mm::madvise(
                self.ptr.add((self.header_bytes + offset) as usize).cast(),
                len as usize,
                Advice::LinuxPopulateWrite,
            );
        }
    }

    /// Maps a segment fd received from a peer, after checking its seals, size and header
    /// (and `nonce`, when given, against the header's).
    ///
    /// Raises `LayoutMismatch` naming what does not match.
    pub fn attach(fd: OwnedFd, nonce: Option<[u8; 16]>) -> Result<Arc<Self>, Error> {
        let mismatch = |what: String| Error::LayoutMismatch { what };
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|e| os_error::<H>("checking", e))?;
        if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
            return Err(mismatch(format!(
                "the {} fd is not sealed against resizing",
                H::WHAT
            )));
        }
        let size = rustix::fs::fstat(&fd)
            .map_err(|e| os_error::<H>("checking", e))?
            .st_size as u64;
        let page = page_bytes().max(4096);
        if size < page + MIN_SEGMENT_CAPACITY {
            return Err(mismatch(format!("the {} fd is only {size} bytes", H::WHAT)));
        }
        // Read the constants through a header-page-only mapping first.
        let fd = Arc::new(fd);
        let probe = Segment::<H>::map(fd.clone(), page, 0, false, 0)?;
        // SAFETY: the probe maps a full page, page-aligned and readable.
        let (capacity, header_nonce) = unsafe { H::check(probe.ptr, page, size) }?;
        drop(probe);
        if nonce.is_some_and(|n| n != header_nonce) {
            return Err(mismatch(format!(
                "the {}'s nonce differs from the handshake's",
                H::WHAT
            )));
        }
        Ok(Arc::new(Segment::<H>::map(
            fd, page, capacity, false, capacity,
        )?))
    }

    /// A fresh (peer-side) mapping of the same memfd (used after a detach).
    pub fn remap(&self) -> Result<Arc<Self>, Error> {
        Ok(Arc::new(Segment::<H>::map(
            self.fd.clone(),
            self.header_bytes,
            self.capacity,
            false,
            self.capacity,
        )?))
    }

    pub fn fd(&self) -> &Arc<OwnedFd> {
        &self.fd
    }

    pub fn header(&self) -> &H {
        // SAFETY: page-aligned header initialised by create (or checked by attach); after
        // that only its atomics are touched through shared references (SegmentHeader).
        unsafe { &*(self.ptr as *const H) }
    }

    /// First byte of the data area (`capacity` bytes).
    pub fn data(&self) -> *mut u8 {
        // SAFETY: header_bytes < len.
        unsafe { self.ptr.add(self.header_bytes as usize) }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn header_bytes(&self) -> u64 {
        self.header_bytes
    }

    /// Replaces the pages covering data bytes `[offset, offset+len)` (rounded out to pages)
    /// of *this* mapping by private anonymous copies at the same addresses: views into them
    /// keep their addresses and contents while the memory underneath is reused.
    ///
    /// # Safety
    /// No thread may write those bytes through this mapping during the call (readers are
    /// fine: they see the same contents before and after), and the caller must never again
    /// use this mapping's data area for ring traffic.
    pub unsafe fn privatize(&self, offset: u64, len: u64) -> Result<(), Error> {
        let page = page_bytes();
        let start = (offset / page) * page;
        let end = (offset + len).next_multiple_of(page).min(self.capacity);
        if end <= start {
            return Ok(());
        }
        // SAFETY: start < end <= capacity, so the target lies inside our data area.
        let target = unsafe { self.ptr.add((self.header_bytes + start) as usize) };
        // SAFETY: [target, target + n) is page-aligned, inside our own mapping (SAFETY
        // invariant (6) of TRANSPORT.md §8); the caller rules out concurrent writers.
        unsafe { replace_with_private_copy(target, (end - start) as usize) }
            .map_err(|e| os_error::<H>("detaching", e))
    }

    /// A private (copy-on-write) writeable mapping of `len` data bytes at `slot`, which must
    /// be page-aligned; None if it is not, or the mapping fails (the caller copies instead).
    pub fn map_private(&self, slot: u64, len: u64) -> Option<PrivateMap> {
        let page = page_bytes();
        let offset = self.header_bytes + slot;
        if offset % page != 0 || len == 0 || slot.checked_add(len)? > self.capacity {
            return None;
        }
        let maplen = len.next_multiple_of(page) as usize;
        // SAFETY: a fresh private mapping of our memfd at a page-aligned offset inside the
        // file (slot + len <= capacity, so offset + maplen <= the file size rounded to a
        // page, which the file has: header + capacity are both page multiples).
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                maplen,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
                self.fd.as_fd(),
                offset,
            )
        }
        .ok()?;
        Some(PrivateMap {
            ptr: ptr.cast(),
            len: maplen,
        })
    }
}

/// Copies the `n` bytes at `target` (page-aligned, a multiple of the page size) into a
/// fresh private anonymous mapping and moves it over `[target, target + n)`.
///
/// # Safety
/// `[target, target + n)` must be page-aligned and lie inside a mapping the caller owns, and
/// nothing may write it during the call.
unsafe fn replace_with_private_copy(target: *mut u8, n: usize) -> Result<(), rustix::io::Errno> {
    // SAFETY: a fresh private anonymous mapping; nothing aliases it.
    let anon = unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            n,
            ProtFlags::READ | ProtFlags::WRITE,
            MapFlags::PRIVATE,
        )
    }?;
    // SAFETY: both ranges are n bytes, mapped, and distinct mappings; the caller guarantees
    // no concurrent writer of the source.
    unsafe { std::ptr::copy_nonoverlapping(target, anon.cast::<u8>(), n) };
    // SAFETY: moves the anonymous pages over [target, target+n), a page-aligned range inside
    // the caller's own mapping; MREMAP_FIXED replaces the old pages atomically, so a
    // concurrent reader sees old or new bytes, which are equal.
    let moved =
        unsafe { rustix::mm::mremap_fixed(anon, n, n, MremapFlags::MAYMOVE, target.cast()) };
    if let Err(err) = moved {
        // SAFETY: anon is our own mapping of n bytes, unused.
        unsafe {
            let _ = rustix::mm::munmap(anon, n);
        }
        return Err(err);
    }
    Ok(())
}

/// A private, copy-on-write mapping of one leased leaf of a segment (unmapped on drop).
pub struct PrivateMap {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a mapping of our own; writes only through numpy views (the Python program's data
// race, as with any array).
unsafe impl Send for PrivateMap {}
// SAFETY: as above.
unsafe impl Sync for PrivateMap {}

impl LeafMapping for PrivateMap {
    fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Replaces the mapping's pages by anonymous copies at the same addresses, so it no
    /// longer follows (nor keeps alive) the segment's file: done before a trainer gives up
    /// its hold while views live (closing, or the worker moved to a fresh segment). A
    /// concurrent write through a view may be lost (TRANSPORT.md §5).
    fn detach(&self) -> Result<(), Error> {
        // SAFETY: our own page-aligned mapping of len bytes; only the user's own views
        // write it.
        unsafe { replace_with_private_copy(self.ptr, self.len) }.map_err(|err| Error::Io {
            op: "detaching",
            path: "cross-trainer cache segment".to_string(),
            source: err.into(),
        })
    }
}

impl Drop for PrivateMap {
    fn drop(&mut self) {
        // SAFETY: our own mapping; the last view into it is gone (the lease owning it drops).
        unsafe {
            let _ = rustix::mm::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// Smallest data area of any segment (both the ring's and the window's minimum).
const MIN_SEGMENT_CAPACITY: u64 = layout::MIN_CAPACITY;

// SAFETY: RingHeader is #[repr(C, align(128))] and at most 4096 bytes (layout.rs asserts);
// init writes a whole header, check validates every constant the ring relies on.
unsafe impl SegmentHeader for RingHeader {
    const MEMFD_NAME: &'static str = "dataservice-ring";
    const WHAT: &'static str = "ring";
    const IO_PATH: &'static str = "shared-memory ring";
    const PEER_WRITES_DATA: bool = true;

    fn valid_capacity(capacity_bytes: u64) -> bool {
        layout::valid_capacity(capacity_bytes)
    }

    unsafe fn init(ptr: *mut u8, header_bytes: u64, capacity_bytes: u64, nonce: [u8; 16]) {
        let header = RingHeader::new(
            capacity_bytes,
            header_bytes as u32,
            nonce,
            rustix::process::getpid().as_raw_nonzero().get() as u32,
        );
        // SAFETY: the caller's contract (page-aligned, so the 128-byte alignment holds).
        unsafe { std::ptr::write(ptr as *mut RingHeader, header) };
    }

    unsafe fn check(ptr: *const u8, page: u64, size: u64) -> Result<(u64, [u8; 16]), Error> {
        // SAFETY: the caller maps a full page; the constants are plain data written before
        // the fd was sent (the creator never changes them).
        let c = unsafe { std::ptr::read(ptr as *const layout::Constants) };
        let mismatch = |what: String| Error::LayoutMismatch { what };
        if c.magic != layout::MAGIC || c.layout_version != layout::LAYOUT_VERSION {
            return Err(mismatch(format!(
                "magic {:?} layout_version {}, expected {:?} {}",
                c.magic,
                c.layout_version,
                layout::MAGIC,
                layout::LAYOUT_VERSION
            )));
        }
        if u64::from(c.header_bytes) != page
            || !layout::valid_capacity(c.capacity_bytes)
            || page + c.capacity_bytes != size
            || c.max_frame_bytes != layout::max_frame_bytes(c.capacity_bytes)
        {
            return Err(mismatch(format!(
                "header {} + capacity {} bytes does not match the {size}-byte segment",
                c.header_bytes, c.capacity_bytes
            )));
        }
        Ok((c.capacity_bytes, c.nonce))
    }
}

// SAFETY: ptr..ptr+len stays mapped until drop; the header page starts at ptr (written by
// create, or validated by attach) and the data area (capacity bytes) follows header_bytes.
unsafe impl Region for Segment<RingHeader> {
    fn header(&self) -> &RingHeader {
        Segment::header(self)
    }
    fn data(&self) -> *mut u8 {
        Segment::data(self)
    }
    fn capacity(&self) -> u64 {
        self.capacity
    }
    fn reserved_bytes(&self) -> u64 {
        Segment::reserved_bytes(self)
    }
    fn reserve(&self, end: u64) -> Result<(), Error> {
        Segment::reserve(self, end)
    }
}

/// 16 random bytes naming a segment in its handshake (a peer checks them against the
/// header, so a stray fd is not taken for the segment offered).
pub fn random_nonce() -> [u8; 16] {
    let mut n = [0u8; 16];
    if rustix::rand::getrandom(&mut n, rustix::rand::GetRandomFlags::empty()).is_err() {
        let t = std::time::Instant::now().elapsed().as_nanos() ^ u128::from(std::process::id());
        n = t.to_le_bytes();
    }
    n
}

/// MemAvailable from /proc/meminfo (bytes), or 0 if unknown.
pub fn mem_available_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

fn libc_enomem() -> i32 {
    rustix::io::Errno::NOMEM.raw_os_error()
}

/// What [`Segment::reserve`] rounds each allocation step up to.
const RESERVE_STEP_BYTES: u64 = 1 << 20;

/// `fallocate` of `[offset, offset + len)` of a segment's memfd (its size is set).
fn allocate(fd: &OwnedFd, offset: u64, len: u64) -> Result<(), Error> {
    rustix::fs::fallocate(fd, FallocateFlags::empty(), offset, len).map_err(|err| {
        Error::ShmExhausted {
            requested_bytes: len,
            available_bytes: mem_available_bytes(),
            source: err.into(),
        }
    })
}

/// `ShmExhausted` if this process's memory cgroup has less than `bytes` free.
fn check_cgroup(bytes: u64) -> Result<(), Error> {
    match cgroup_free_bytes() {
        Some(free) if bytes > free => Err(Error::ShmExhausted {
            requested_bytes: bytes,
            available_bytes: free.min(mem_available_bytes()),
            source: std::io::Error::from_raw_os_error(libc_enomem()),
        }),
        _ => Ok(()),
    }
}

/// Memory limit minus usage of this process's cgroup (v2 `memory.max`/`memory.current`, or
/// v1 `memory.limit_in_bytes`/`memory.usage_in_bytes`), or None if unlimited or unknown.
pub fn cgroup_free_bytes() -> Option<u64> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let (limit, usage) = if controllers.is_empty() {
            (
                format!("/sys/fs/cgroup{path}/memory.max"),
                format!("/sys/fs/cgroup{path}/memory.current"),
            )
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                format!("/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"),
                format!("/sys/fs/cgroup/memory{path}/memory.usage_in_bytes"),
            )
        } else {
            continue;
        };
        let read = |p: &str| {
            std::fs::read_to_string(p)
                .ok()
                .map(|s| s.trim().to_string())
        };
        let (Some(limit), Some(usage)) = (read(&limit), read(&usage)) else {
            continue;
        };
        let (Ok(limit), Ok(usage)) = (limit.parse::<u64>(), usage.parse::<u64>()) else {
            continue; // "max": unlimited
        };
        if limit >= 1 << 60 {
            continue; // v1's "unlimited"
        }
        return Some(limit.saturating_sub(usage));
    }
    None
}
