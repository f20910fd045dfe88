//! A bound shared by the caches of every process: each process's cache has a bound of its own, but
//! a user can start any number of processes, so what they hold together is bounded too.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Units (bytes, entries) held by several caches together, within a bound.
pub struct SharedBudget {
    used: AtomicUsize,
    max: usize,
}

impl SharedBudget {
    pub const fn new(max: usize) -> Self {
        SharedBudget { used: AtomicUsize::new(0), max }
    }

    pub fn fits(&self, cost: usize) -> bool {
        self.used.load(Ordering::Relaxed).saturating_add(cost) <= self.max
    }

    /// Takes `cost` units if they fit.
    pub fn take(&self, cost: usize) -> bool {
        self.used.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| used.checked_add(cost).filter(|&total| total <= self.max)).is_ok()
    }

    pub fn release(&self, cost: usize) {
        self.used.fetch_sub(cost, Ordering::Relaxed);
    }

    /// Units held by all caches on this budget.
    #[cfg(test)]
    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }
}
