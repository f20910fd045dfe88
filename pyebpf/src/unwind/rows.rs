//! Unwind rules of whole functions, tabulated once per file and shared by every process that maps
//! it.
//!
//! framehop keeps the rule of each address it has unwound, a few hundred per process, and for any
//! other address runs the function's CFI program from its start up to that address. CPython's eval
//! loop, built without frame pointers, is one function of thousands of CFI rows, and a busy
//! interpreter is sampled at an address of it not seen before in most samples: at fleet rates that
//! run was most of what unwinding cost. Here the first look-up in a function runs its program once to
//! the end and keeps every row; later look-ups in it, from any process mapping the file, are a
//! binary search. Rules this table does not express are left to framehop, frame by frame.

use std::collections::HashMap;

use framehop::x86_64::UnwindRegsX86_64;
use gimli::{BaseAddresses, CfaRule, EhFrame, EhFrameHdr, EndianSlice, LittleEndian, ParsedEhFrameHdr, RegisterRule, UnwindContext, UnwindSection, X86_64};

use super::{FileCfi, FileId};

/// Rows kept at most over all files (all dropped at once when exceeded): about 20 bytes each.
const MAX_ROWS: usize = 1 << 17;
/// Rows of one function kept at most; its addresses past them are left to framehop.
const MAX_FUNCTION_ROWS: usize = 1 << 14;

/// How to find a frame's caller, for the frames this table handles. The return address is always
/// at CFA - 8 (other places are left to framehop).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Rule {
    /// No return address: the stack's root.
    Root,
    /// CFA = sp + `cfa_offset`; the caller's rbp is saved at CFA + `bp_at`, or rbp is unchanged.
    Sp { cfa_offset: u32, bp_at: Option<i32> },
    /// CFA = rbp + 16, the caller's rbp saved at rbp: a frame-pointer frame.
    FramePointer,
    /// Anything else: framehop's path.
    Other,
}

/// One function's rows: each row's rule holds from its start to the next row's.
struct Function {
    start: u64,
    end: u64,
    /// (start - the function's start, rule), ascending.
    rows: Box<[(u32, Rule)]>,
}

impl Function {
    fn rule_at(&self, svma: u64) -> Rule {
        let Ok(offset) = u32::try_from(svma - self.start) else { return Rule::Other };
        match self.rows.partition_point(|&(start, _)| start <= offset) {
            0 => Rule::Other,
            after => self.rows[after - 1].1,
        }
    }
}

/// The functions tabulated so far, per file.
#[derive(Default)]
pub(super) struct RuleTables {
    /// Each file's functions, by start address.
    files: HashMap<FileId, Vec<Function>>,
    rows: usize,
    /// Times the tables started afresh: what was derived before may have had functions since gone.
    resets: u64,
}

/// What the rules over a stretch of a file are derived from (see [`RuleTables::source_over`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RulesSource {
    resets: u64,
    functions: usize,
}

impl RuleTables {
    /// The rule at `svma` (a stated address) of `file`, whose unwind sections are `cfi`; None where
    /// the file's `.eh_frame_hdr` covers no function there.
    pub(super) fn rule(&mut self, file: FileId, cfi: &FileCfi, svma: u64) -> Option<Rule> {
        let functions = self.files.entry(file).or_default();
        let at = functions.partition_point(|function| function.start <= svma);
        if let Some(function) = at.checked_sub(1).map(|i| &functions[i]).filter(|function| svma < function.end) {
            return Some(function.rule_at(svma));
        }
        let function = tabulate(cfi, svma)?;
        let rule = function.rule_at(svma);
        if self.rows + function.rows.len() > MAX_ROWS {
            self.start_afresh();
        }
        let functions = self.files.entry(file).or_default();
        let at = functions.partition_point(|known| known.start <= function.start);
        // Functions that overlap (only malformed CFI has them) are kept once each.
        if at.checked_sub(1).is_some_and(|before| functions[before].start == function.start) {
            return Some(rule);
        }
        self.rows += function.rows.len();
        functions.insert(at, function);
        Some(rule)
    }

    /// Drops every function tabulated.
    pub(super) fn start_afresh(&mut self) {
        self.files.clear();
        self.rows = 0;
        self.resets += 1;
    }

    /// What [`Self::rules_over`] the same stretch reads: the functions of `file` tabulated there,
    /// counted, and the times the tables started afresh. Functions are only added in between, so
    /// the rules there are as derived before while this is as it was: a function tabulated
    /// elsewhere in the file does not change them.
    pub(super) fn source_over(&self, file: FileId, start: u64, end: u64) -> RulesSource {
        let functions = self.functions_over(file, start, end).count();
        RulesSource { resets: self.resets, functions }
    }

    /// The functions of `file` tabulated that overlap `start..end`, by start address.
    fn functions_over(&self, file: FileId, start: u64, end: u64) -> impl Iterator<Item = &Function> {
        let functions = self.files.get(&file).map_or(&[][..], |functions| &functions[..]);
        let first = functions.partition_point(|function| function.end <= start);
        functions[first..].iter().take_while(move |function| function.start < end)
    }

    /// The rules of `file` over the stated addresses `start..end`, from the functions tabulated
    /// there, into `out`: (address, rule) pairs, each in force up to the next, [`Rule::Other`]
    /// where no function is tabulated.
    pub(super) fn rules_over(&self, file: FileId, start: u64, end: u64, out: &mut Vec<(u64, Rule)>) {
        out.clear();
        let mut push = |at: u64, rule: Rule| {
            if out.last().is_none_or(|&(_, last)| last != rule) {
                out.push((at, rule));
            }
        };
        let mut at = start;
        for function in self.functions_over(file, start, end) {
            if function.start > at {
                push(at, Rule::Other);
                at = function.start;
            }
            push(at, function.rule_at(at));
            for &(offset, rule) in &function.rows {
                let row = function.start + u64::from(offset);
                if at < row && row < end.min(function.end) {
                    push(row, rule);
                }
            }
            at = function.end;
        }
        if at < end {
            push(at, Rule::Other);
        }
    }
}

type Section<'a> = EndianSlice<'a, LittleEndian>;

/// A file's `.eh_frame` and its parsed `.eh_frame_hdr`, with the addresses their pointers are
/// relative to.
pub(super) struct EhSections<'a> {
    pub bases: BaseAddresses,
    pub eh_frame: EhFrame<Section<'a>>,
    pub header: ParsedEhFrameHdr<Section<'a>>,
}

impl<'a> EhSections<'a> {
    /// None if `cfi` has no `.eh_frame` and `.eh_frame_hdr`, or the header does not parse.
    pub(super) fn of(cfi: &'a FileCfi) -> Option<EhSections<'a>> {
        let (hdr_range, hdr) = cfi.eh_frame_hdr.as_ref()?;
        let (eh_frame_range, eh_frame) = cfi.eh_frame.as_ref()?;
        let mut bases = BaseAddresses::default().set_eh_frame_hdr(hdr_range.start).set_eh_frame(eh_frame_range.start);
        if let Some(got) = &cfi.got {
            bases = bases.set_got(got.start);
        }
        let header = EhFrameHdr::new(hdr, LittleEndian).parse(&bases, 8).ok()?;
        Some(EhSections { bases, eh_frame: EhFrame::new(eh_frame, LittleEndian), header })
    }
}

/// Runs the CFI program of the function of `cfi` covering `svma` to its end, keeping every row.
fn tabulate(cfi: &FileCfi, svma: u64) -> Option<Function> {
    let EhSections { bases, eh_frame, header } = EhSections::of(cfi)?;
    let fde = header.table()?.fde_for_address(&eh_frame, &bases, svma, EhFrame::cie_from_offset).ok()?;
    let (start, end) = (fde.initial_address(), fde.end_address());
    let mut context = Box::new(UnwindContext::new());
    let mut table = fde.rows(&eh_frame, &bases, &mut context).ok()?;
    let mut rows = Vec::new();
    loop {
        let row = match table.next_row() {
            Ok(Some(row)) => row,
            Ok(None) => break,
            // A program that does not parse to its end: framehop's path from here.
            Err(_) => {
                let resume = rows.last().map_or(0, |&(offset, _)| offset + 1);
                rows.push((resume, Rule::Other));
                break;
            }
        };
        let offset = u32::try_from(row.start_address().checked_sub(start)?).ok()?;
        if rows.len() == MAX_FUNCTION_ROWS {
            // Too long: framehop's path from here.
            rows.push((offset, Rule::Other));
            break;
        }
        rows.push((offset, rule_of(row.cfa(), row.register(X86_64::RBP).as_ref(), row.register(X86_64::RA).as_ref())));
    }
    Some(Function { start, end, rows: rows.into_boxed_slice() })
}

/// The rule a row states, where framehop would cache the same rule for it (its own cached rules
/// are the reference: `tests::tabulated_rules_unwind_as_framehop_does`).
fn rule_of<T: gimli::ReaderOffset>(cfa: &CfaRule<T>, bp: Option<&RegisterRule<T>>, ra: Option<&RegisterRule<T>>) -> Rule {
    match ra {
        None | Some(RegisterRule::Undefined) => return Rule::Root,
        Some(RegisterRule::Offset(-8)) => {}
        _ => return Rule::Other,
    }
    let bp_at = match bp {
        None | Some(RegisterRule::Undefined | RegisterRule::SameValue) => None,
        Some(RegisterRule::Offset(offset)) => Some(*offset),
        _ => return Rule::Other,
    };
    match *cfa {
        CfaRule::RegisterAndOffset { register: X86_64::RSP, offset } => {
            // Offsets in whole words, as the stack holds them.
            let word_aligned = |offset: i64| offset % 8 == 0;
            let Ok(cfa_offset) = u32::try_from(offset) else { return Rule::Other };
            if !word_aligned(offset) || bp_at.is_some_and(|at| !word_aligned(at) || i32::try_from(at).is_err()) {
                return Rule::Other;
            }
            Rule::Sp { cfa_offset, bp_at: bp_at.map(|at| at as i32) }
        }
        CfaRule::RegisterAndOffset { register: X86_64::RBP, offset: 16 } if bp_at == Some(-16) => Rule::FramePointer,
        _ => Rule::Other,
    }
}

/// Why a frame could not be unwound by its rule.
#[derive(Debug)]
pub(super) struct Stuck;

/// Applies `rule` (not [`Rule::Other`]) to the frame in `regs`: the caller's return address, with
/// `regs` moved to the caller, or None at the stack's root. `first` is the sampled frame itself,
/// whose stack copy starts at its sp.
pub(super) fn step(rule: Rule, first: bool, regs: &mut UnwindRegsX86_64, read_stack: &mut impl FnMut(u64) -> Result<u64, ()>) -> Result<Option<u64>, Stuck> {
    let (sp, bp) = (regs.sp(), regs.bp());
    let (cfa, caller_bp) = match rule {
        Rule::Root => return Ok(None),
        Rule::Other => return Err(Stuck),
        Rule::Sp { cfa_offset, bp_at } => {
            let cfa = sp.checked_add(u64::from(cfa_offset)).ok_or(Stuck)?;
            let caller_bp = match bp_at {
                None => bp,
                Some(at) => {
                    let saved = cfa.checked_add_signed(i64::from(at)).ok_or(Stuck)?;
                    match read_stack(saved) {
                        Ok(value) => value,
                        // An epilogue may have popped rbp already without saying so; the copy
                        // holds nothing below the sampled sp.
                        Err(()) if first && saved < sp => bp,
                        Err(()) => return Err(Stuck),
                    }
                }
            };
            (cfa, caller_bp)
        }
        Rule::FramePointer => {
            if bp == 0 {
                return Ok(None);
            }
            let cfa = bp.checked_add(16).ok_or(Stuck)?;
            if cfa <= sp {
                return Err(Stuck);
            }
            (cfa, read_stack(bp).map_err(|()| Stuck)?)
        }
    };
    let return_address = read_stack(cfa.checked_sub(8).ok_or(Stuck)?).map_err(|()| Stuck)?;
    if return_address == 0 {
        return Ok(None);
    }
    if cfa == sp && return_address == regs.ip() {
        return Err(Stuck);
    }
    regs.set_ip(return_address);
    regs.set_sp(cfa);
    regs.set_bp(caller_bp);
    Ok(Some(return_address))
}
