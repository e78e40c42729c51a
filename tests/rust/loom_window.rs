//! loom models of the cross-trainer cache window's hold/reclaim protocol (rust/shm/holds.rs,
//! TRANSPORT.md §8): a trainer's hold (and the worker's grant before it) keeps the writer
//! off a frame until the trainer has read it, whether the trainer drops its view or gives
//! the slot up (deactivate detaches the view first). Run:
//!   .ci/loom, or: RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test --release --no-default-features --test loom_window
//! Frame bytes are modelled as loom `UnsafeCell`s: loom reports any read of them by the
//! trainer and write by the writer that are not ordered by happens-before, which is what a
//! missing Release/Acquire pairing (SYNC(hold)) or a writer ignoring a hold would cause.
#![cfg(loom)]

use std::sync::Arc;

use _core::error::Error;
use _core::shm::holds::{
    min_hold, Grants, HeapHolds, HoldTable, HoldWords, LeafMapping, Place, WindowLog,
};
use loom::cell::UnsafeCell;
use loom::sync::Mutex;

const CAP: u64 = 256;
const FRAME: u64 = 128;
const OLD: u64 = 1;
const NEW: u64 = 2;

/// The window's data: one payload word per 64-byte slot.
struct Data(Vec<UnsafeCell<u64>>);

// SAFETY: the cells are only touched under the protocol the models check; loom reports
// any access pair that is not ordered by happens-before.
unsafe impl Sync for Data {}

impl Data {
    fn new() -> Arc<Self> {
        Arc::new(Data((0..CAP / 64).map(|_| UnsafeCell::new(0)).collect()))
    }
    fn cell(&self, pos: u64) -> &UnsafeCell<u64> {
        &self.0[((pos & (CAP - 1)) / 64) as usize]
    }
    fn read(&self, pos: u64) -> u64 {
        // SAFETY: loom checks that no write races with this read.
        self.cell(pos).with(|p| unsafe { *p })
    }
    fn write(&self, pos: u64, v: u64) {
        // SAFETY: loom checks that no other access races with this write.
        self.cell(pos).with_mut(|p| unsafe { *p = v })
    }
}

/// The worker's window with frames A (pos 0, value OLD) and B (pos 128), full.
fn window(data: &Data) -> WindowLog {
    let mut log = WindowLog::new(CAP);
    for pos in [0, FRAME] {
        data.write(pos, OLD);
        log.push(pos, FRAME, 64, 1);
    }
    log
}

/// The writer appends one frame, which needs A's bytes; it retries while a grant or a
/// hold is in the way (the real writer's caller waits, then abandons the segment).
fn write_over_a(mut log: WindowLog, grants: &Grants, holds: &dyn HoldWords, data: &Data) {
    loop {
        // Grants first, then holds (WindowWriter::reserve).
        let held = grants.min().min(min_hold(holds.holds()));
        match log.try_place(FRAME, 64, held) {
            Place::Write { pos, slot, .. } => {
                assert_eq!(slot, 0, "the new frame takes A's bytes");
                data.write(pos, NEW);
                log.push(pos, FRAME, 64, 1);
                return;
            }
            Place::EvictOldest => {
                log.evict_oldest();
            }
            Place::Held => loom::thread::yield_now(),
        }
    }
}

#[test]
fn a_granted_then_held_frame_is_never_overwritten_while_read() {
    loom::model(|| {
        let data = Data::new();
        let log = window(&data);
        let holds = HeapHolds::new(2);
        let grants = Arc::new(Grants::default());
        // The worker grants slot 0 the reply starting at A before sending it.
        grants.set(0, 0);
        let trainer = {
            let (data, holds, grants) = (data.clone(), holds.clone(), grants.clone());
            loom::thread::spawn(move || {
                let table = HoldTable::new(holds, 0).unwrap();
                let hold = table.acquire(0);
                // DONE: the worker clears the grant once the trainer's holds are stored.
                grants.clear(0);
                assert_eq!(data.read(0), OLD, "the writer overwrote a held frame");
                drop(hold);
            })
        };
        write_over_a(log, &grants, &*holds, &data);
        trainer.join().unwrap();
        assert_eq!(data.read(0), NEW);
    });
}

/// A leased leaf whose "private mapping" copies the frame's word when detached.
struct CopyOnDetach {
    data: Arc<Data>,
    copy: Arc<Mutex<Option<u64>>>,
}

impl LeafMapping for CopyOnDetach {
    fn ptr(&self) -> *mut u8 {
        std::ptr::null_mut()
    }
    fn detach(&self) -> Result<(), Error> {
        *self.copy.lock().unwrap() = Some(self.data.read(0));
        Ok(())
    }
}

#[test]
fn giving_the_slot_up_detaches_views_before_the_writer_reuses_their_bytes() {
    loom::model(|| {
        let data = Data::new();
        let log = window(&data);
        let holds = HeapHolds::new(1);
        let grants = Grants::default();
        let copy = Arc::new(Mutex::new(None));
        let trainer = {
            let (data, holds, copy) = (data.clone(), holds.clone(), copy.clone());
            // The hold is stored before the writer starts (the reply's grant, cleared by
            // DONE, covered the frame until then: the first model).
            let table = HoldTable::new(holds, 0).unwrap();
            let hold = table.acquire(0);
            let map = Box::new(CopyOnDetach { data, copy });
            let leaf = table.lease(map, 0, hold);
            loom::thread::spawn(move || {
                // The trainer closes its reader while the view (leaf) lives on.
                assert_eq!(table.deactivate(), 1);
                drop(leaf);
            })
        };
        write_over_a(log, &grants, &*holds, &data);
        trainer.join().unwrap();
        assert_eq!(
            *copy.lock().unwrap(),
            Some(OLD),
            "the view's private copy caught the writer's bytes"
        );
    });
}
