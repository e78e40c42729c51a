//! The ring's shared-memory object (TRANSPORT.md §3): a sealed, pre-faulted memfd.
//!
//! `memfd_create` (no name in /dev/shm, so a crash at any instant leaks nothing: the pages
//! go with the last fd and mapping), `fallocate` of the whole size (a full tmpfs or memory
//! cgroup gives ENOSPC/ENOMEM now instead of SIGBUS on a later write), then seals
//! SHRINK|GROW|SEAL so no one can truncate it under a mapping.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use rustix::fs::{FallocateFlags, MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, MremapFlags, ProtFlags};

use crate::error::Error;
use crate::shm::layout::{self, RingHeader};
use crate::shm::ring::Region;

#[cfg(target_endian = "big")]
compile_error!("the shared-memory ring format is little-endian only");

const _: () = assert!(cfg!(target_has_atomic = "64"));

/// Size of the header page (the data area starts page-aligned).
pub fn page_bytes() -> u64 {
    rustix::param::page_size() as u64
}

/// One mapping of a ring's memfd: header page + data area. Unmapped on drop.
pub struct Mapping {
    ptr: *mut u8,
    len: usize,
    header_bytes: u64,
    capacity: u64,
    fd: Arc<OwnedFd>,
}

// SAFETY: the mapping is plain shared memory; concurrent access is governed by the ring
// protocol (atomics in the header, byte ranges owned by one side at a time).
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len is the range mmap returned to us and nobody else unmaps it; the
        // last Arc<Mapping> (held by leases too) is gone, so no view points into it.
        unsafe {
            let _ = rustix::mm::munmap(self.ptr.cast(), self.len);
        }
    }
}

fn os_error(op: &'static str, err: rustix::io::Errno) -> Error {
    Error::Io {
        op,
        path: "shared-memory ring".to_string(),
        source: err.into(),
    }
}

impl Mapping {
    /// Maps the whole segment. `populate` pre-faults the page tables (the producer's
    /// mapping, written from the start); a consumer's mapping is not populated: its pages
    /// exist already (fallocate), so a first read of one is a minor fault, and mapping a
    /// 64 MiB ring takes 0.1 ms instead of ~13 ms, which a handshake waits for.
    fn map(
        fd: Arc<OwnedFd>,
        header_bytes: u64,
        capacity: u64,
        populate: bool,
    ) -> Result<Self, Error> {
        let len = (header_bytes + capacity) as usize;
        let flags = if populate {
            MapFlags::SHARED | MapFlags::POPULATE
        } else {
            MapFlags::SHARED
        };
        // SAFETY: a fresh shared mapping of our (sealed, fully allocated) memfd at an address
        // the kernel picks; nothing aliases it yet.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                flags,
                fd.as_fd(),
                0,
            )
        }
        .map_err(|e| os_error("mapping", e))?;
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
            header_bytes,
            capacity,
            fd,
        })
    }

    /// A new sealed memfd ring of `capacity_bytes`, header initialised; the producer's side.
    pub fn create(capacity_bytes: u64, nonce: [u8; 16]) -> Result<Arc<Self>, Error> {
        if !layout::valid_capacity(capacity_bytes) {
            return Err(Error::InvalidRingSize { capacity_bytes });
        }
        let header_bytes = page_bytes().max(4096);
        let total = header_bytes + capacity_bytes;
        let fd = rustix::fs::memfd_create(
            "dataservice-ring",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .map_err(|e| os_error("creating", e))?;
        // A memory cgroup at its limit answers fallocate on shmem with its OOM killer, not
        // ENOMEM: refuse up front what the cgroup cannot hold.
        if let Some(free) = cgroup_free_bytes() {
            if total > free {
                return Err(Error::ShmExhausted {
                    requested_bytes: total,
                    available_bytes: free.min(mem_available_bytes()),
                    source: std::io::Error::from_raw_os_error(libc_enomem()),
                });
            }
        }
        if let Err(err) = rustix::fs::fallocate(&fd, FallocateFlags::empty(), 0, total) {
            return Err(Error::ShmExhausted {
                requested_bytes: total,
                available_bytes: mem_available_bytes(),
                source: err.into(),
            });
        }
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(|e| os_error("sealing", e))?;
        let map = Mapping::map(Arc::new(fd), header_bytes, capacity_bytes, true)?;
        let header = RingHeader::new(
            capacity_bytes,
            header_bytes as u32,
            nonce,
            rustix::process::getpid().as_raw_nonzero().get() as u32,
        );
        // SAFETY: the mapping is at least one page, page-aligned (so the header's 128-byte
        // alignment holds), and no other process has the fd yet.
        unsafe { std::ptr::write(map.ptr as *mut RingHeader, header) };
        Ok(Arc::new(map))
    }

    /// Maps a ring fd received from a peer, after checking its seals, size and header.
    pub fn attach(fd: OwnedFd, nonce: Option<[u8; 16]>) -> Result<Arc<Self>, Error> {
        let mismatch = |what: String| Error::LayoutMismatch { what };
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|e| os_error("checking", e))?;
        if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
            return Err(mismatch(
                "the ring fd is not sealed against resizing".into(),
            ));
        }
        let size = rustix::fs::fstat(&fd)
            .map_err(|e| os_error("checking", e))?
            .st_size as u64;
        let page = page_bytes().max(4096);
        if size < page + layout::MIN_CAPACITY {
            return Err(mismatch(format!("the ring fd is only {size} bytes")));
        }
        // Read the constants through a header-page-only mapping first.
        let probe = Mapping::map(Arc::new(fd), page, 0, false)?;
        // SAFETY: the probe maps a full page, page-aligned; the constants are plain data
        // written before the fd was sent (the creator never changes them).
        let c = unsafe { std::ptr::read(probe.ptr as *const layout::Constants) };
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
        if let Some(nonce) = nonce {
            if nonce != c.nonce {
                return Err(mismatch(
                    "the ring's nonce differs from the handshake's".into(),
                ));
            }
        }
        let fd = probe.fd.clone();
        drop(probe);
        Ok(Arc::new(Mapping::map(fd, page, c.capacity_bytes, false)?))
    }

    /// A fresh mapping of the same memfd (used after a detach).
    pub fn remap(&self) -> Result<Arc<Self>, Error> {
        Ok(Arc::new(Mapping::map(
            self.fd.clone(),
            self.header_bytes,
            self.capacity,
            false,
        )?))
    }

    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Replaces the pages covering data bytes `[offset, offset+len)` (rounded out to pages)
    /// of *this* mapping by private anonymous copies at the same addresses: views into them
    /// keep their addresses and contents while the ring memory underneath is reused.
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
        let n = (end - start) as usize;
        // SAFETY: start < end <= capacity, so the target lies inside our data area.
        let target = unsafe { self.ptr.add((self.header_bytes + start) as usize) };
        // SAFETY: a fresh private anonymous mapping; nothing aliases it.
        let anon = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                n,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE,
            )
        }
        .map_err(|e| os_error("detaching", e))?;
        // SAFETY: both ranges are n bytes, mapped, and distinct mappings; the caller
        // guarantees no concurrent writer of the source.
        unsafe { std::ptr::copy_nonoverlapping(target, anon.cast::<u8>(), n) };
        // SAFETY: moves the anonymous pages over [target, target+n), a page-aligned range
        // inside our own mapping (SAFETY invariant (6) of TRANSPORT.md §8); MREMAP_FIXED
        // replaces the old pages atomically, so a concurrent reader sees old or new bytes,
        // which are equal.
        let moved =
            unsafe { rustix::mm::mremap_fixed(anon, n, n, MremapFlags::MAYMOVE, target.cast()) };
        if let Err(err) = moved {
            // SAFETY: anon is our own mapping of n bytes, unused.
            unsafe {
                let _ = rustix::mm::munmap(anon, n);
            }
            return Err(os_error("detaching", err));
        }
        Ok(())
    }
}

// SAFETY: ptr..ptr+len stays mapped until drop; the header page starts at ptr (written by
// create, or validated by attach) and the data area (capacity bytes) follows header_bytes.
unsafe impl Region for Mapping {
    fn header(&self) -> &RingHeader {
        // SAFETY: page-aligned, initialised header; only atomics are touched through it
        // after creation, and the constants are immutable.
        unsafe { &*(self.ptr as *const RingHeader) }
    }
    fn data(&self) -> *mut u8 {
        // SAFETY: header_bytes < len.
        unsafe { self.ptr.add(self.header_bytes as usize) }
    }
    fn capacity(&self) -> u64 {
        self.capacity
    }
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
