//! Element frames, chunking of elements bigger than a frame, the peer's liveness, and the
//! Python codec over frames (TRANSPORT.md §4, §6).

pub mod chunk;
#[cfg(feature = "python")]
pub mod codec;
pub mod frame;
#[cfg(feature = "python")]
pub mod npy;
#[cfg(not(loom))]
pub mod peer;
pub mod reader;
#[cfg(not(loom))]
pub mod writer;
