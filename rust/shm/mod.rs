//! Shared memory: the ring's header layout, the memfd segment (one type for the ring and
//! the cache window), the SPSC ring protocol, the cross-trainer cache window's reclaim
//! protocol (hold table, grants, writer log) and its segment.

#[cfg(not(loom))]
pub mod detach;
pub mod holds;
pub mod layout;
pub mod ring;
#[cfg(not(loom))]
pub mod segment;
#[cfg(not(loom))]
pub mod window;
