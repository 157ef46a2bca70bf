//! A request from outside to stop a run (SIGINT, SIGTERM). The binary registers the signal
//! handlers that set it; the training loops look at it between steps, so a run stops at a step
//! boundary, writes a checkpoint of that step, and returns — never inside a checkpoint write or
//! an optimizer step.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The number of the signal that asked the run to stop, or 0 while none has.
#[derive(Clone, Debug, Default)]
pub struct Interrupt(Arc<AtomicUsize>);

impl Interrupt {
    /// The cell a signal handler stores its signal number in.
    pub fn cell(&self) -> &Arc<AtomicUsize> {
        &self.0
    }

    /// The signal that asked the run to stop, if one has.
    pub fn signal(&self) -> Option<i32> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            s => i32::try_from(s).ok(),
        }
    }

    /// Asks the run to stop as `signal` would (tests, and embedding programs).
    pub fn request(&self, signal: i32) {
        self.0.store(signal.max(1) as usize, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_seen_by_every_clone() {
        let a = Interrupt::default();
        let b = a.clone();
        assert_eq!(b.signal(), None);
        a.request(15);
        assert_eq!(b.signal(), Some(15));
    }
}
