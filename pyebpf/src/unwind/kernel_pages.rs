//! The rules handed to the eBPF program, a page of a process's code at a time, so that it unwinds
//! the stacks of processes without frame pointers itself and sends no stack copy.
//!
//! A page is published once a stack unwound here to its root passed through it, with the rules of
//! every function tabulated there so far; it is published again when more of its functions have
//! been tabulated since (each sample the program cannot unwind comes here with a copy, and its
//! unwind tabulates what was missing). A page stays only while its process maps the same file at
//! the same place.
//!
//! The rules are the file's, wherever it is mapped: a process whose first unwind passes through a
//! file is handed at once the pages of it published for other processes (where a loop runs hot in
//! one interpreter it does in the next), and from then on every page of the file published for any
//! process, so its later samples need no copy to find them: of many processes running one
//! interpreter, one copy teaches them all.

use std::collections::{HashMap, HashSet};
use std::hash::BuildHasher;

use aya::maps::{MapData, MapError};
use pyebpf_common::unwind::{
    unwind_row, UnwindPage, UnwindPageKey, MAX_UNWIND_PAGES, UNWIND_PAGE_ROWS, UNWIND_PAGE_SIZE, UNWIND_STRETCHES, UNWIND_STRETCH_ROWS, UNWIND_STRETCH_SIZE,
    UNWIND_STRETCH_UNKNOWN,
};

use super::rows::{Rule, RuleTables, RulesSource};
use super::{mapped_at, FileId, MappedFile, Unwound};

/// A change to the eBPF program's pages.
#[derive(Debug)]
pub enum PageUpdate {
    Set(UnwindPageKey, Box<UnwindPage>),
    Remove(UnwindPageKey),
}

/// What a published page was derived from.
struct Published {
    file: FileId,
    base_avma: u64,
    /// What its rules were derived from, when it was.
    source: RulesSource,
    /// A hash of its rows (0: they did not fit a page). Were two pages' rows to hash alike, the
    /// later would not be set: the earlier still holds, for fewer functions.
    rows: u64,
}

/// The pages published and the changes not yet handed over.
#[derive(Default)]
pub(super) struct KernelPages {
    published: HashMap<UnwindPageKey, Published>,
    /// The pages published for any process, by file: their start in its stated addresses.
    hot: HashMap<FileId, HashSet<u64>>,
    hot_count: usize,
    /// The processes handed the hot pages of each file: they are handed its later pages too.
    seeded: HashMap<FileId, HashSet<u32>>,
    updates: Vec<PageUpdate>,
    /// Scratch for one page's rules.
    rules: Vec<(u64, Rule)>,
    hasher: hashbrown::DefaultHashBuilder,
}

impl KernelPages {
    /// Publishes the pages `unwound` (reached its root in `pid`) went through that were not, or
    /// whose rows changed since with more of their file's functions tabulated; the same pages of
    /// the same files go to the processes seeded with them. `files_of` gives a process's files
    /// with unwind sections, sorted by address.
    pub(super) fn publish<'f>(&mut self, pid: u32, unwound: &Unwound, files_of: impl Fn(u32) -> Option<&'f [MappedFile]>, tables: &RuleTables) {
        let Some(files) = files_of(pid) else { return };
        for (index, &addr) in unwound.addrs.iter().enumerate() {
            // A caller's rule is its call instruction's, as the program looks it up.
            let lookup = if index == 0 { addr } else { addr.wrapping_sub(1) };
            let page = lookup & !(UNWIND_PAGE_SIZE - 1);
            let Some(file) = mapped_at(files, page) else { continue };
            if self.publish_page(pid, page, file, tables) {
                self.share(pid, file, page.wrapping_sub(file.base_avma), &files_of, tables);
            }
            self.seed(pid, file, files, tables);
        }
    }

    /// Publishes `pid`'s page at `page`, where `file` lies, unless it was with these rules;
    /// whether its rows changed.
    fn publish_page(&mut self, pid: u32, page: u64, file: &MappedFile, tables: &RuleTables) -> bool {
        let key = UnwindPageKey { tgid: pid, _pad: 0, page };
        let start = key.page.wrapping_sub(file.base_avma);
        let source = tables.source_over(file.id, start, start + UNWIND_PAGE_SIZE);
        let known = self.published.get(&key);
        if known.is_some_and(|known| known.source == source) {
            return false;
        }
        if known.is_none() && self.published.len() >= MAX_UNWIND_PAGES as usize {
            return false;
        }
        tables.rules_over(file.id, start, start + UNWIND_PAGE_SIZE, &mut self.rules);
        let page = encode_page(start, &self.rules);
        let rows = page.as_ref().map_or(0, |page| self.hasher.hash_one(&page.rows[..page.len as usize]) | 1);
        let changed = known.is_none_or(|known| known.rows != rows);
        self.published.insert(key, Published { file: file.id, base_avma: file.base_avma, source, rows });
        match page {
            Some(page) if changed => self.updates.push(PageUpdate::Set(key, Box::new(page))),
            // Rows too dense for a page: its samples stay with userspace.
            None if changed => self.updates.push(PageUpdate::Remove(key)),
            _ => {}
        }
        if self.hot_count >= MAX_UNWIND_PAGES as usize {
            self.hot.clear();
            self.hot_count = 0;
        }
        if self.hot.entry(file.id).or_default().insert(start) {
            self.hot_count += 1;
        }
        changed
    }

    /// Hands `pid`, the first time an unwind of it passes through `file`, the pages of the file
    /// published for other processes, while half the program's room for pages is free.
    fn seed(&mut self, pid: u32, file: &MappedFile, files: &[MappedFile], tables: &RuleTables) {
        if self.published.len() >= MAX_UNWIND_PAGES as usize / 2 || !self.seeded.entry(file.id).or_default().insert(pid) {
            return;
        }
        let Some(hot) = self.hot.get(&file.id) else { return };
        let pages: Vec<u64> = hot.iter().map(|start| file.base_avma.wrapping_add(*start)).collect();
        for page in pages {
            if mapped_alike(files, page, file) {
                self.publish_page(pid, page, file, tables);
            }
        }
    }

    /// Hands the page at stated address `start` of `file`, just published for `pid` with new rows,
    /// to the other processes seeded with the file, while half the program's room is free.
    fn share<'f>(&mut self, pid: u32, file: &MappedFile, start: u64, files_of: &impl Fn(u32) -> Option<&'f [MappedFile]>, tables: &RuleTables) {
        let Some(seeded) = self.seeded.get(&file.id) else { return };
        let others: Vec<u32> = seeded.iter().copied().filter(|&other| other != pid).collect();
        for other in others {
            if self.published.len() >= MAX_UNWIND_PAGES as usize / 2 {
                return;
            }
            let Some(files) = files_of(other) else { continue };
            let Some(theirs) = files.iter().find(|theirs| theirs.id == file.id) else { continue };
            let page = theirs.base_avma.wrapping_add(start);
            if mapped_alike(files, page, theirs) {
                self.publish_page(other, page, theirs, tables);
            }
        }
    }

    /// `pid` now maps `files` (sorted by address): its pages where another file, or the same
    /// elsewhere, lies go.
    pub(super) fn remapped(&mut self, pid: u32, files: &[MappedFile]) {
        self.seeded.retain(|_, seeded| {
            seeded.remove(&pid);
            !seeded.is_empty()
        });
        let updates = &mut self.updates;
        self.published.retain(|key, known| {
            let same = key.tgid != pid || mapped_at(files, key.page).is_some_and(|file| file.id == known.file && file.base_avma == known.base_avma);
            if !same {
                updates.push(PageUpdate::Remove(*key));
            }
            same
        });
    }

    /// `pid` exited or replaced its program: all its pages go.
    pub(super) fn forget(&mut self, pid: u32) {
        self.remapped(pid, &[]);
    }

    pub(super) fn take_updates(&mut self) -> Vec<PageUpdate> {
        std::mem::take(&mut self.updates)
    }
}

/// Whether `file` lies at `page` of a process mapping `files`, mapped as there (not another part of
/// it, or another file), and `page` starts a page.
fn mapped_alike(files: &[MappedFile], page: u64, file: &MappedFile) -> bool {
    page.is_multiple_of(UNWIND_PAGE_SIZE) && mapped_at(files, page).is_some_and(|at| at.id == file.id && at.base_avma == file.base_avma)
}

/// The eBPF program's `UNWIND_PAGES`.
pub struct UnwindPagesMap(aya::maps::HashMap<MapData, UnwindPageKey, UnwindPage>);

impl UnwindPagesMap {
    pub fn new(map: aya::maps::Map) -> Result<UnwindPagesMap, MapError> {
        Ok(UnwindPagesMap(map.try_into()?))
    }

    pub fn update(&mut self, updates: Vec<PageUpdate>) {
        for update in updates {
            match update {
                // A page not set (the map is full) leaves its samples to userspace, as before.
                PageUpdate::Set(key, page) => {
                    if let Err(err) = self.0.insert(key, *page, 0) {
                        log::debug!("process {}: unwind rules of {:#x} stay in userspace: {err}", key.tgid, key.page);
                    }
                }
                PageUpdate::Remove(key) => {
                    let _ = self.0.remove(&key);
                }
            }
        }
    }
}

/// The page whose code starts at stated address `start`, from `rules` over it (as
/// [`RuleTables::rules_over`] gives them); None where it has more rows than a page holds.
fn encode_page(start: u64, rules: &[(u64, Rule)]) -> Option<UnwindPage> {
    let mut page = UnwindPage { len: 0, _pad: 0, stretch_rows: [0; UNWIND_STRETCHES], rows: [unwind_row::PAST_END; UNWIND_PAGE_ROWS] };
    let mut len = 0usize;
    for &(at, rule) in rules {
        let offset = u32::try_from(at.checked_sub(start)?).ok().filter(|&offset| u64::from(offset) < UNWIND_PAGE_SIZE)?;
        let row = encode_rule(rule);
        // Rules the program applies alike are one row.
        if len > 0 && page.rows[len - 1] & !OFFSET_MASK == row {
            continue;
        }
        // Room for a full stretch's scan past the last row, over rows past the end, from any row
        // up to UNWIND_STRETCH_UNKNOWN.
        if len + UNWIND_STRETCH_ROWS >= UNWIND_PAGE_ROWS {
            return None;
        }
        page.rows[len] = offset | row;
        len += 1;
    }
    if len == 0 || unwind_row::offset(page.rows[0]) != 0 {
        return None;
    }
    page.len = len as u32;
    let rows = &page.rows[..len];
    for (stretch, first) in page.stretch_rows.iter_mut().enumerate() {
        let stretch_start = stretch as u32 * UNWIND_STRETCH_SIZE as u32;
        let in_force = rows.partition_point(|&row| unwind_row::offset(row) <= stretch_start) - 1;
        let inside = rows[in_force + 1..].iter().take_while(|&&row| unwind_row::offset(row) < stretch_start + UNWIND_STRETCH_SIZE as u32).count();
        *first = if inside > UNWIND_STRETCH_ROWS { UNWIND_STRETCH_UNKNOWN } else { u8::try_from(in_force).ok()? };
    }
    Some(page)
}

/// The bits of a row that hold its offset, and [`unwind_row::PAST_END`].
const OFFSET_MASK: u32 = 2 * UNWIND_PAGE_SIZE as u32 - 1;

/// `rule` as a row at offset 0: [`unwind_row::UNKNOWN`] where the program cannot apply it.
fn encode_rule(rule: Rule) -> u32 {
    let (kind, cfa_words, bp_words) = match rule {
        Rule::Root => (unwind_row::ROOT, 0, 0),
        Rule::FramePointer => (unwind_row::FRAME_POINTER, 0, 0),
        Rule::Sp { cfa_offset, bp_at } => {
            let cfa_words = cfa_offset / 8;
            let bp = match bp_at {
                None => Some((unwind_row::SP, 0)),
                Some(at) if at < 0 => {
                    u32::try_from(-at / 8).ok().filter(|&words| words <= unwind_row::MAX_BP_WORDS).map(|words| (unwind_row::SP_SAVED_BP, words))
                }
                Some(_) => None,
            };
            match bp {
                Some((kind, bp_words)) if cfa_words <= unwind_row::MAX_CFA_WORDS => (kind, cfa_words, bp_words),
                _ => (unwind_row::UNKNOWN, 0, 0),
            }
        }
        Rule::Other => (unwind_row::UNKNOWN, 0, 0),
    };
    unwind_row::encode(0, kind, cfa_words, bp_words)
}

/// The eBPF program's walk (`unwind_by_rules`), step for step, over `pages` of `pid`, reading the
/// stack with `read`: the addresses and frame bases where it reaches the root.
#[cfg(test)]
pub(super) fn walk_as_the_program_does(
    pages: &HashMap<UnwindPageKey, Box<UnwindPage>>,
    pid: u32,
    ip: u64,
    sp: u64,
    bp: u64,
    read: impl Fn(u64) -> Option<u64>,
) -> Option<Unwound> {
    let (mut pc, mut sp, mut bp) = (ip, sp, bp);
    let mut unwound = Unwound { addrs: vec![ip], frame_bases: Vec::new(), complete: true };
    for frame in 0..pyebpf_common::MAX_USER_FRAMES - 1 {
        let lookup = if frame == 0 { pc } else { pc - 1 };
        let page = pages.get(&UnwindPageKey { tgid: pid, _pad: 0, page: lookup & !(UNWIND_PAGE_SIZE - 1) })?;
        let row = tests::row_at(page, (lookup & (UNWIND_PAGE_SIZE - 1)) as u32);
        let (cfa, caller_bp) = match unwind_row::kind(row) {
            unwind_row::ROOT => return Some(unwound),
            unwind_row::SP => (sp + u64::from(unwind_row::cfa_words(row)) * 8, bp),
            unwind_row::SP_SAVED_BP => {
                let cfa = sp + u64::from(unwind_row::cfa_words(row)) * 8;
                let saved = cfa - u64::from(unwind_row::bp_words(row)) * 8;
                (cfa, if frame == 0 && saved < sp { bp } else { read(saved)? })
            }
            unwind_row::FRAME_POINTER if bp == 0 => return Some(unwound),
            unwind_row::FRAME_POINTER => (bp + 16, read(bp)?),
            _ => return None,
        };
        if cfa <= sp {
            return None;
        }
        let ret = read(cfa - 8)?;
        if ret == 0 {
            return Some(unwound);
        }
        unwound.frame_bases.push(cfa - 16);
        unwound.addrs.push(ret);
        (pc, sp, bp) = (ret, cfa, caller_bp);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const SP8: Rule = Rule::Sp { cfa_offset: 8, bp_at: None };

    pub(super) fn row_at(page: &UnwindPage, offset: u32) -> u32 {
        // As the eBPF program finds it.
        let first = page.stretch_rows[(offset / UNWIND_STRETCH_SIZE as u32) as usize] as usize;
        let mut row = page.rows[first];
        for next in first + 1..=first + UNWIND_STRETCH_ROWS {
            if unwind_row::offset(page.rows[next]) > offset {
                break;
            }
            row = page.rows[next];
        }
        row & !OFFSET_MASK
    }

    #[test]
    fn a_page_finds_each_offsets_rule_as_the_rules_state_it() {
        let start = 0x1000;
        let rules = [
            (start, Rule::Other),
            (start + 0x10, SP8),
            (start + 0x11, Rule::Sp { cfa_offset: 16, bp_at: Some(-16) }),
            (start + 0x90, Rule::FramePointer),
            (start + 0x95, SP8),
            (start + 0xfff, Rule::Root),
        ];
        let page = encode_page(start, &rules).expect("encodes");
        for offset in 0..UNWIND_PAGE_SIZE as u32 {
            let stated = rules.iter().rev().find(|&&(at, _)| at <= start + u64::from(offset)).unwrap().1;
            assert_eq!(row_at(&page, offset), encode_rule(stated), "offset {offset:#x}");
        }
        assert_eq!(unwind_row::cfa_words(encode_rule(Rule::Sp { cfa_offset: 16, bp_at: Some(-16) })), 2);
        assert_eq!(unwind_row::bp_words(encode_rule(Rule::Sp { cfa_offset: 16, bp_at: Some(-16) })), 2);
    }

    #[test]
    fn rules_a_page_cannot_hold_or_apply_are_refused() {
        // More rows in one stretch than the program scans: that stretch's rule is unknown, the
        // next stretch's is the last row's.
        let dense: Vec<_> = (0..UNWIND_STRETCH_ROWS as u64 + 2).map(|i| (0x1000 + i, Rule::Sp { cfa_offset: 8 * (i as u32 % 2 + 1), bp_at: None })).collect();
        let page = encode_page(0x1000, &dense).expect("encodes");
        for offset in [0, 5, UNWIND_STRETCH_SIZE as u32 - 1] {
            assert_eq!(unwind_row::kind(row_at(&page, offset)), unwind_row::UNKNOWN, "offset {offset}");
        }
        assert_eq!(row_at(&page, UNWIND_STRETCH_SIZE as u32), encode_rule(dense.last().unwrap().1));
        // More rows than a page holds.
        let crowded: Vec<_> = (0..UNWIND_PAGE_ROWS as u64).map(|i| (0x1000 + i * 16, Rule::Sp { cfa_offset: 8 * (i as u32 % 2 + 1), bp_at: None })).collect();
        assert!(encode_page(0x1000, &crowded).is_none());
        // Rules that must start the page.
        assert!(encode_page(0x1000, &[(0x1010, SP8)]).is_none());
        // A saved rbp above the CFA, or a CFA too far: not applied in the kernel.
        assert_eq!(unwind_row::kind(encode_rule(Rule::Sp { cfa_offset: 8, bp_at: Some(8) })), unwind_row::UNKNOWN);
        assert_eq!(unwind_row::kind(encode_rule(Rule::Sp { cfa_offset: 8 << 20, bp_at: None })), unwind_row::UNKNOWN);
    }
}
