//! Shared memory: the ring's header layout, the memfd segment, the SPSC ring protocol,
//! and the cross-trainer cache's shared window segment.

pub mod layout;
pub mod ring;
#[cfg(not(loom))]
pub mod segment;
#[cfg(not(loom))]
pub mod window;
