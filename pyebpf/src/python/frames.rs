//! One process's frame resolver: turns frames the kernel recorded into interned frames, and owns
//! the proof that a code object decoded now is the one that ran at the sample (its `co_version`,
//! or before 3.12 a fingerprint of its names, read at the sample and again now).

use std::collections::HashMap;

use pyebpf_common::PyFrameRecord;

use crate::budget::SharedBudget;
use crate::chain::{FrameLink, LinkKind};
use crate::cpython::memory::{ReadMemory, WriteMemory};
use crate::cpython::{PyError, PyProcess, MAX_CACHED_CODES};
use crate::merge::PyStackItem;
use crate::stack::{Frame, FrameCarry, FrameId, FrameTable, PythonFrame};

/// A Python stack entry with its frame interned.
pub type PyItem = PyStackItem<FrameId>;

/// Frames resolved per process at most (then forgotten, and resolved again on demand), and over all
/// processes together.
const MAX_FRAME_IDS: usize = 100_000;
static ALL_FRAME_IDS: SharedBudget = SharedBudget::new(1_000_000);

/// The frame of each (code object, `co_version`, instruction) seen in one process: versions are
/// never reused, so a hit is the same code object at the same place. `None`: a frame Python's own
/// view leaves out. Bounded per process and, with every other process's, in total.
pub(super) struct FrameIds {
    ids: hashbrown::HashMap<(u64, u32, u64), Option<FrameId>>,
    max: usize,
    /// Ids held by every process's `FrameIds`.
    total: &'static SharedBudget,
}

impl FrameIds {
    fn new() -> Self {
        FrameIds::bounded(MAX_FRAME_IDS, &ALL_FRAME_IDS)
    }

    pub(super) fn bounded(max: usize, total: &'static SharedBudget) -> Self {
        FrameIds { ids: hashbrown::HashMap::new(), max, total }
    }

    pub(super) fn get(&self, key: &(u64, u32, u64)) -> Option<Option<FrameId>> {
        self.ids.get(key).copied()
    }

    /// Keeps `id` under `key`. Past either bound this process forgets its ids first; while the
    /// others hold the whole total it keeps none.
    pub(super) fn insert(&mut self, key: (u64, u32, u64), id: Option<FrameId>) {
        if self.ids.len() >= self.max || !self.total.fits(1) {
            self.clear();
        }
        if !self.total.take(1) {
            return;
        }
        if self.ids.insert(key, id).is_some() {
            self.total.release(1);
        }
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.ids.len()
    }

    fn clear(&mut self) {
        self.total.release(self.ids.len());
        self.ids.clear();
    }

    fn ids_mut(&mut self) -> impl Iterator<Item = &mut FrameId> {
        self.ids.values_mut().flatten()
    }
}

impl Drop for FrameIds {
    fn drop(&mut self) {
        self.clear();
    }
}

/// What pyebpf reads of a profiled process, and the one field it may write (the 3.15 marker).
pub trait Memory: ReadMemory + WriteMemory {}

impl<M: ReadMemory + WriteMemory> Memory for M {}

/// Resolves the frames of one process.
pub(super) struct Resolver<M> {
    pub(super) py: PyProcess<M>,
    /// `co_version` of each code object decoded, by address: a different version at the same
    /// address is another code object.
    code_versions: HashMap<u64, u32>,
    frame_ids: FrameIds,
}

impl<M: ReadMemory> Resolver<M> {
    pub(super) fn new(py: PyProcess<M>) -> Self {
        Resolver { py, code_versions: HashMap::new(), frame_ids: FrameIds::new() }
    }

    pub(super) fn pid(&self) -> u32 {
        self.py.pid()
    }

    /// A frame the kernel recorded, as a link of its chain.
    pub(super) fn link(&self, frame: &PyFrameRecord) -> FrameLink {
        self.py.link_of(frame, 0)
    }

    /// A recorded frame as a stack item (see [`Self::resolve_link`]).
    pub(super) fn resolve_record(&mut self, frame: &PyFrameRecord, frames: &mut FrameTable) -> Result<Option<PyItem>, PyError> {
        self.resolve_link(&self.link(frame), frame.code_version, frames)
    }

    /// The frames the kernel walked, resolved into `items`; cut (and `true`) at the first frame
    /// whose code object cannot be proven to be the one that ran. `task_at` is set to where in
    /// `items` the frame at `task_frame` ends.
    pub(super) fn resolve_walked(
        &mut self,
        walked: &[PyFrameRecord],
        task_frame: Option<u64>,
        task_at: &mut Option<usize>,
        frames: &mut FrameTable,
        items: &mut Vec<PyItem>,
    ) -> bool {
        for frame in walked {
            let link = self.link(frame);
            match self.resolve_link(&link, frame.code_version, frames) {
                Ok(Some(item)) => items.push(item),
                Ok(None) => {}
                Err(err) => {
                    log::debug!("pid {}: frame {:#x}: {err}", self.pid(), link.addr);
                    return true;
                }
            }
            if task_frame == Some(link.addr) {
                *task_at = Some(items.len());
            }
            // Not on the C stack: no native frame's range can place it.
            if link.kind == LinkKind::EntryCode {
                items.push(PyStackItem::SegmentEnd { entry_frame: 0 });
            }
        }
        false
    }

    /// A frame link as a stack item; `Ok(None)` for frames Python's own view leaves out. The code
    /// object must still be the one with `version`, else the decode would name another function.
    pub(super) fn resolve_link(&mut self, link: &FrameLink, version: u32, frames: &mut FrameTable) -> Result<Option<PyItem>, PyError> {
        if link.kind == LinkKind::Entry {
            return Ok(Some(PyStackItem::SegmentEnd { entry_frame: link.addr }));
        }
        if link.code == 0 {
            return Ok(None);
        }
        let key = (link.code, version, link.instr_ptr);
        if let Some(id) = self.frame_ids.get(&key) {
            return Ok(id.map(PyStackItem::Frame));
        }
        let resolved = self.decode_link(link, version)?;
        let id = resolved.map(|frame| frames.intern(Frame::Python(frame)));
        self.frame_ids.insert(key, id);
        Ok(id.map(PyStackItem::Frame))
    }

    /// Decodes a frame's function and line from its code object, checking the object is still
    /// the one with `version`.
    fn decode_link(&mut self, link: &FrameLink, version: u32) -> Result<Option<PythonFrame>, PyError> {
        if self.code_versions.get(&link.code) == Some(&version) {
            return Ok(self.py.frame_info(link)?.map(|r| r.frame));
        }
        self.py.forget_code(link.code);
        self.code_versions.remove(&link.code);
        let resolved = self.py.frame_info(link)?;
        // Versions are never reused: the same one now means the object lived since the sample
        // (on 3.11, a fingerprint of its names: the same one means an object of the same name).
        let now = self.py.code_version(link.code)?;
        if now != version {
            self.py.forget_code(link.code);
            return Err(PyError::Chain(format!("code object {:#x} was freed since the sample", link.code)));
        }
        if self.code_versions.len() >= MAX_CACHED_CODES {
            // Bounded like the code cache: versions are checked again after this.
            self.code_versions.clear();
        }
        self.code_versions.insert(link.code, now);
        Ok(resolved.map(|r| r.frame))
    }

    /// Moves the interned frames this resolver keeps into the next table.
    pub(super) fn carry_frames(&mut self, carry: &mut FrameCarry<'_>) {
        for id in self.frame_ids.ids_mut() {
            *id = carry.carry(*id);
        }
    }

    /// Forgets every frame id (they belong to a table that is gone).
    pub(super) fn clear_frame_ids(&mut self) {
        self.frame_ids.clear();
    }
}
