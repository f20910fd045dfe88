//! A cache bounded in entries and in bytes, for decoded code objects: a target decides how many
//! code objects it runs, so one process may hold at most `MAX_ENTRIES` entries and `MAX_BYTES`
//! bytes of them, and all processes together at most `MAX_TOTAL_BYTES` (a user can start any
//! number of processes). Past a bound, entries are evicted in CLOCK order (the oldest first, except
//! that one used since the hand last passed gets another round), and each eviction is counted; a
//! process that has nothing left to evict while the others hold the whole total keeps nothing.

use std::collections::{HashMap, VecDeque};

use crate::budget::SharedBudget;

/// Most code objects kept per process.
pub const MAX_ENTRIES: usize = 16_384;
/// Most bytes of decoded code objects kept per process (each costs `CodeInfo::heap_bytes` plus
/// `ENTRY_OVERHEAD`).
pub const MAX_BYTES: usize = 32 << 20;
/// Most bytes of decoded code objects kept by all processes together.
pub const MAX_TOTAL_BYTES: usize = 256 << 20;
/// Bytes an entry costs beyond its value's own: the map slot, the queue slot and the `Arc` header.
pub const ENTRY_OVERHEAD: usize = 96;

/// The budget of every process's code-object cache.
pub static ALL_PROCESSES: SharedBudget = SharedBudget::new(MAX_TOTAL_BYTES);

struct Entry<V> {
    value: V,
    cost: usize,
    used: bool,
}

pub struct BoundedCache<V> {
    entries: HashMap<u64, Entry<V>>,
    /// Every key once, in CLOCK order.
    order: VecDeque<u64>,
    bytes: usize,
    max_entries: usize,
    max_bytes: usize,
    /// What this cache shares its bytes with.
    shared: &'static SharedBudget,
}

impl<V: Clone> BoundedCache<V> {
    pub fn new(max_entries: usize, max_bytes: usize, shared: &'static SharedBudget) -> Self {
        BoundedCache { entries: HashMap::new(), order: VecDeque::new(), bytes: 0, max_entries, max_bytes, shared }
    }

    pub fn get(&mut self, key: u64) -> Option<V> {
        let entry = self.entries.get_mut(&key)?;
        entry.used = true;
        Some(entry.value.clone())
    }

    /// Keeps `value` (which costs `cost` bytes) under `key`, evicting others as the bounds require;
    /// returns how many were evicted. A value larger than the whole budget is not kept, nor is one
    /// the shared budget has no room for once this cache is empty.
    pub fn insert(&mut self, key: u64, value: V, cost: usize) -> u64 {
        let cost = cost + ENTRY_OVERHEAD;
        if cost > self.max_bytes || self.max_entries == 0 {
            return 0;
        }
        self.remove(key);
        let mut evicted = 0;
        while self.entries.len() >= self.max_entries || self.bytes + cost > self.max_bytes || !self.shared.fits(cost) {
            let Some(oldest) = self.order.pop_front() else { break };
            let Some(entry) = self.entries.get_mut(&oldest) else { continue };
            if entry.used {
                entry.used = false;
                self.order.push_back(oldest);
            } else {
                self.bytes -= entry.cost;
                self.shared.release(entry.cost);
                self.entries.remove(&oldest);
                evicted += 1;
            }
        }
        if !self.shared.take(cost) {
            return evicted;
        }
        self.bytes += cost;
        self.order.push_back(key);
        self.entries.insert(key, Entry { value, cost, used: false });
        evicted
    }

    pub fn remove(&mut self, key: u64) {
        if let Some(entry) = self.entries.remove(&key) {
            self.bytes -= entry.cost;
            self.shared.release(entry.cost);
            self.order.retain(|&k| k != key);
        }
    }

    pub fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
        self.shared.release(self.bytes);
        self.bytes = 0;
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Bytes held, overheads included.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl<V> Drop for BoundedCache<V> {
    fn drop(&mut self) {
        self.shared.release(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static UNBOUNDED: SharedBudget = SharedBudget::new(usize::MAX);

    #[test]
    fn stays_within_its_entry_bound() {
        let mut cache = BoundedCache::new(4, usize::MAX, &UNBOUNDED);
        let evicted: u64 = (0..10).map(|key| cache.insert(key, key, 0)).sum();
        assert_eq!((cache.len(), evicted), (4, 6));
        assert_eq!(cache.get(0), None);
        assert_eq!(cache.get(9), Some(9));
    }

    #[test]
    fn stays_within_its_byte_bound() {
        let mut cache = BoundedCache::new(usize::MAX, 10 * (1000 + ENTRY_OVERHEAD), &UNBOUNDED);
        let evicted: u64 = (0..100).map(|key| cache.insert(key, key, 1000)).sum();
        assert_eq!((cache.len(), evicted), (10, 90));
        assert!(cache.bytes() <= 10 * (1000 + ENTRY_OVERHEAD));
        // Something larger than the whole budget is not kept, and evicts nothing.
        assert_eq!(cache.insert(1000, 1000, 1 << 20), 0);
        assert_eq!((cache.get(1000), cache.len()), (None, 10));
    }

    #[test]
    fn entries_in_use_get_a_second_round() {
        let mut cache = BoundedCache::new(3, usize::MAX, &UNBOUNDED);
        for key in 0..3 {
            cache.insert(key, key, 0);
        }
        assert_eq!(cache.get(0), Some(0));
        assert_eq!(cache.insert(3, 3, 0), 1);
        assert_eq!(cache.get(0), Some(0), "the entry just used was evicted");
        assert_eq!(cache.get(1), None, "the oldest unused entry should have gone");
    }

    #[test]
    fn replacing_a_key_keeps_the_accounting() {
        let mut cache = BoundedCache::new(10, usize::MAX, &UNBOUNDED);
        cache.insert(1, 1, 100);
        cache.insert(1, 2, 50);
        assert_eq!((cache.len(), cache.bytes(), cache.get(1)), (1, 50 + ENTRY_OVERHEAD, Some(2)));
        cache.clear();
        assert_eq!((cache.len(), cache.bytes()), (0, 0));
    }

    #[test]
    fn caches_on_one_budget_stay_within_it_together() {
        static FOUR: SharedBudget = SharedBudget::new(4 * (100 + ENTRY_OVERHEAD));
        let mut first = BoundedCache::new(usize::MAX, usize::MAX, &FOUR);
        let mut second = BoundedCache::new(usize::MAX, usize::MAX, &FOUR);
        for key in 0..3 {
            first.insert(key, key, 100);
        }
        // One more fits; past it the second cache evicts its own entries, never the first's.
        assert_eq!(second.insert(10, 10, 100), 0);
        assert_eq!(second.insert(11, 11, 100), 1);
        assert_eq!((second.get(10), second.get(11), first.len()), (None, Some(11), 3));
        assert_eq!(FOUR.used(), 4 * (100 + ENTRY_OVERHEAD));
        // A cache with nothing of its own to evict keeps nothing while the others hold it all.
        second.clear();
        first.insert(3, 3, 100);
        assert_eq!((second.insert(12, 12, 100), second.get(12), second.bytes()), (0, None, 0));
        // A cache that goes (its process exited) gives its bytes back.
        drop(first);
        assert_eq!(FOUR.used(), 0);
        second.insert(12, 12, 100);
        assert_eq!((second.get(12), FOUR.used()), (Some(12), 100 + ENTRY_OVERHEAD));
    }
}
