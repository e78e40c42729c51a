//! Shared memory: the ring's header layout, the memfd segment, and the SPSC ring protocol.

pub mod layout;
pub mod ring;
#[cfg(not(loom))]
pub mod segment;
