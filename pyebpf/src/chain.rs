//! Links of an interpreter frame chain: what pyebpf needs of one `_PyInterpreterFrame`, whether
//! the eBPF program read it at the sample or userspace read it from the process.

/// What the walk needs of one `_PyInterpreterFrame`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLink {
    pub addr: u64,
    pub previous: u64,
    /// `f_executable` with tag bits cleared.
    pub code: u64,
    pub instr_ptr: u64,
    pub kind: LinkKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkKind {
    /// A frame running a code object.
    Code,
    /// An entry frame: it ends the segment of one interpreter activation.
    Entry,
    /// A frame running a code object that is also the first of its interpreter activation (3.11's
    /// `is_entry`): it ends its segment.
    EntryCode,
}

impl LinkKind {
    /// The frame runs a code object.
    pub fn runs_code(self) -> bool {
        matches!(self, LinkKind::Code | LinkKind::EntryCode)
    }
}

/// Reads frames from the target process.
pub trait LinkReader {
    type Error;
    fn read_link(&mut self, addr: u64) -> Result<FrameLink, Self::Error>;
}
