use super::*;
use proptest::prelude::*;
use pyebpf_common::unwind::{UnwindPage, UnwindPageKey, UNWIND_PAGE_SIZE};

#[test]
fn the_vdso_has_unwind_information_and_other_bytes_are_refused() {
    let vdso = own_vdso_cfi().expect("this process's vDSO parses");
    assert!(vdso.eh_frame.is_some() && vdso.eh_frame_hdr.is_some(), "{vdso:?}");
    assert!(FileCfi::parse(&b"not an ELF file"[..]).is_err());
}

#[test]
fn a_mapping_belongs_to_the_segment_whose_page_it_starts() {
    // Segments as `ld` lays out a Rust executable: the code segment starts mid-page in the file
    // and one page later in memory, and the page holding its start also holds the end of the
    // read-only segment before it.
    let cfi = FileCfi {
        segments: vec![Segment { file_offset: 0, file_size: 0x19f4b0, svma: 0 }, Segment { file_offset: 0x19f4b0, file_size: 0x351670, svma: 0x1a04b0 }],
        ..Default::default()
    };
    assert_eq!(cfi.base_avma(0x5600_0000_0000 + 0x1a0000, 0x19f000), Some(0x5600_0000_0000));
    // A non-PIE executable maps at its stated addresses.
    let fixed = FileCfi { segments: vec![Segment { file_offset: 0x1000, file_size: 0x5000, svma: 0x401000 }], ..Default::default() };
    assert_eq!(fixed.base_avma(0x401000, 0x1000), Some(0));
    assert_eq!(fixed.base_avma(0x401000, 0x9000), None);
}

/// An unwinder with its own maps, as a sample resolver pairs them.
#[derive(Default)]
struct Unwinding {
    unwinder: StackUnwinder,
    maps: MapsCache,
}

impl Unwinding {
    fn unwind(&mut self, pid: u32, snapshot: &Snapshot<'_>) -> Unwound {
        self.unwinder.unwind(&mut self.maps, pid, snapshot)
    }
}

/// A stack unwound, and the registers and copy it was unwound from.
struct Captured {
    unwound: Unwound,
    regs: (u64, u64, u64),
    copy: Vec<u8>,
}

fn unwind_here(depth: u32, unwinder: &mut Unwinding) -> (Unwound, u64) {
    let captured = capture_here(depth, unwinder);
    (captured.unwound, captured.regs.1)
}

#[inline(never)]
fn capture_here(depth: u32, unwinder: &mut Unwinding) -> Captured {
    if depth > 0 {
        let result = capture_here(depth - 1, unwinder);
        std::hint::black_box(&result);
        return result;
    }
    let (ip, sp, bp): (u64, u64, u64);
    // SAFETY: reads three registers, touches no memory.
    unsafe {
        std::arch::asm!("lea {ip}, [rip]", "mov {sp}, rsp", "mov {bp}, rbp", ip = out(reg) ip, sp = out(reg) sp, bp = out(reg) bp);
    }
    // Our own stack from here up, read through /proc/self/mem as the kernel would copy it: the
    // calls below only write below `sp`.
    let mut copy = vec![0; STACK_SNAPSHOT_MAX];
    let mem = std::fs::File::open("/proc/self/mem").unwrap();
    let len = std::os::unix::fs::FileExt::read_at(&mem, &mut copy, sp).unwrap();
    copy.truncate(len);
    let unwound = unwinder.unwind(std::process::id(), &Snapshot { ip, sp, bp, stack: &copy });
    Captured { unwound, regs: (ip, sp, bp), copy }
}

#[test]
fn unwinds_its_own_stack_through_every_recursion() {
    let mut unwinder = Unwinding::default();
    let (unwound, sp) = unwind_here(6, &mut unwinder);
    let here = unwind_here as *const () as usize as u64;
    // Seven activations of unwind_here (the innermost and six recursive calls) lie on the
    // stack: each recursive call's return address is inside unwind_here.
    let in_unwind_here = unwound.addrs.iter().filter(|&&a| a > here && a < here + 4096).count();
    assert!(in_unwind_here >= 6, "{in_unwind_here} return addresses in unwind_here: {unwound:x?}");
    assert!(unwound.frame_bases.windows(2).all(|w| w[0] < w[1]), "frame bases grow rootwards");
    assert!(unwound.frame_bases.first().is_some_and(|&b| b + 16 > sp));
}

/// The eBPF program's walk over `pages` as process `tgid`, from what `captured` was unwound from.
fn program_walk(pages: &HashMap<UnwindPageKey, Box<UnwindPage>>, tgid: u32, captured: &Captured) -> Option<Unwound> {
    let (ip, sp, bp) = captured.regs;
    let read = |addr: u64| {
        let at = usize::try_from(addr.checked_sub(sp)?).ok()?;
        Some(u64::from_ne_bytes(captured.copy.get(at..at + 8)?.try_into().unwrap()))
    };
    kernel_pages::walk_as_the_program_does(pages, tgid, ip, sp, bp, read)
}

/// This stack captured and unwound to its root, its functions' rules tabulated first (so pages
/// published from it are complete).
fn capture_tabulated(unwinder: &mut Unwinding) -> Captured {
    capture_here(3, unwinder);
    let captured = capture_here(3, unwinder);
    assert!(captured.unwound.complete, "{:x?}", captured.unwound);
    captured
}

/// The innermost and outermost frames of `unwound`: an unwind through their pages only.
fn ends_of(unwound: &Unwound) -> Unwound {
    let addrs = &unwound.addrs;
    Unwound { addrs: vec![addrs[0], addrs[addrs.len() - 1]], complete: true, ..Unwound::default() }
}

/// The program's pages once `updates` are applied to them.
fn apply(updates: Vec<PageUpdate>, pages: &mut HashMap<UnwindPageKey, Box<UnwindPage>>) {
    for update in updates {
        match update {
            PageUpdate::Set(key, page) => pages.insert(key, page),
            PageUpdate::Remove(key) => pages.remove(&key),
        };
    }
}

/// A complete unwind publishes the pages it went through, and the eBPF program's walk over them
/// finds the same frames and frame bases; a process forgotten has them withdrawn.
#[test]
fn published_pages_unwind_as_userspace_did() {
    let mut unwinder = Unwinding::default();
    let pid = std::process::id();
    let captured = capture_tabulated(&mut unwinder);
    let mut pages = HashMap::new();
    apply(unwinder.unwinder.take_page_updates(), &mut pages);
    assert!(!pages.is_empty());
    let walked = program_walk(&pages, pid, &captured).expect("the program's walk reaches the root");
    assert_eq!(walked, captured.unwound);
    unwinder.unwinder.forget_process(pid);
    let removed = unwinder.unwinder.take_page_updates().iter().filter(|update| matches!(update, PageUpdate::Remove(_))).count();
    assert_eq!(removed, pages.len());
}

/// A process whose first unwind passes through files that unwinds of another process published
/// pages of is handed those pages: from them the program walks its whole stack.
#[test]
fn a_process_is_handed_the_pages_another_published_of_its_files() {
    let mut unwinder = Unwinding::default();
    let pid = std::process::id();
    let captured = capture_tabulated(&mut unwinder);
    unwinder.unwinder.take_page_updates();
    // Another process mapping the same files alike, whose unwind went through the pages of
    // its innermost and outermost frames only.
    let other = pid | 0x4000_0000;
    let unwinding = &mut unwinder.unwinder;
    let files = &unwinding.processes[&pid].files[..];
    unwinding.pages.publish(other, &ends_of(&captured.unwound), |_| Some(files), &unwinding.rules);
    let updates = unwinding.take_page_updates();
    assert!(updates.iter().all(|update| matches!(update, PageUpdate::Set(key, _) | PageUpdate::Remove(key) if key.tgid == other)), "{updates:?}");
    let mut pages = HashMap::new();
    apply(updates, &mut pages);
    assert!(pages.len() > 2, "only the pages its own unwind went through: {}", pages.len());
    let walked = program_walk(&pages, other, &captured).expect("the program's walk reaches the root");
    assert_eq!(walked, captured.unwound);
}

/// A process seeded with files is handed the pages of them published later for another: once
/// one of them has unwound a stack, the program walks it in the other too, without a copy of it.
#[test]
fn pages_published_later_for_one_process_reach_the_others_seeded_with_their_files() {
    let mut unwinder = Unwinding::default();
    let pid = std::process::id();
    let captured = capture_tabulated(&mut unwinder);
    // Two other processes mapping the same files alike, with none of the pages published yet.
    let (first, second) = (pid | 0x4000_0000, pid | 0x2000_0000);
    let files = &unwinder.unwinder.processes[&pid].files[..];
    let rules = &unwinder.unwinder.rules;
    let mut published = KernelPages::default();
    let ends = ends_of(&captured.unwound);
    published.publish(first, &ends, |_| Some(files), rules);
    published.publish(second, &ends, |_| Some(files), rules);
    let mut pages = HashMap::new();
    apply(published.take_updates(), &mut pages);
    assert_eq!(program_walk(&pages, second, &captured), None, "the pages of its innermost and outermost frames walk the whole stack");
    // The first process's stack through the pages between.
    published.publish(first, &captured.unwound, |_| Some(files), rules);
    apply(published.take_updates(), &mut pages);
    assert_eq!(program_walk(&pages, second, &captured), Some(captured.unwound.clone()));
}

/// Every rule tabulated for the functions of this test binary and the C library it maps
/// unwinds a frame as framehop does (framehop's own rules are the reference), as the sampled
/// frame and as a caller, at every row of every function.
#[test]
fn tabulated_rules_unwind_as_framehop_does() {
    let maps = Maps::read_own().unwrap();
    let files = StackUnwinder::new().mapped_files(std::process::id(), &maps);
    let own = std::env::current_exe().unwrap();
    let chosen: Vec<&MappedFile> = files.iter().filter(|file| file.cfi.eh_frame_hdr.is_some()).collect();
    assert!(chosen.len() >= 2, "this binary and the C library have .eh_frame_hdr: {own:?}");
    let mut compared = [0usize; 3];
    for file in chosen {
        let mut unwinder = UnwinderX86_64::new();
        unwinder.add_module(file.cfi.module(String::new(), file.avma.clone(), file.base_avma));
        let mut cache = CacheX86_64::new();
        let mut tables = RuleTables::default();
        for svma in row_starts(&file.cfi) {
            let avma = svma.wrapping_add(file.base_avma);
            if !file.avma.contains(&avma) {
                continue;
            }
            let rule = tables.rule(file.id, &file.cfi, svma).expect("an address with a row has a function");
            if rule == Rule::Other {
                compared[2] += 1;
                continue;
            }
            for address in [FrameAddress::from_instruction_pointer(avma), FrameAddress::from_return_address(avma + 1).unwrap()] {
                let (sp, stack) = (0x7ff0_0000_0000u64, synthetic_stack(0x7ff0_0000_0000, svma));
                let mut read_stack = |addr: u64| -> Result<u64, ()> {
                    let word = usize::try_from(addr.checked_sub(sp).ok_or(())? / 8).map_err(|_| ())?;
                    stack.get(word).copied().ok_or(())
                };
                let mut theirs = UnwindRegsX86_64::new(address.address(), sp, sp + 0x200);
                let mut ours = theirs;
                let expected = unwinder.unwind_frame(address, &mut theirs, &mut cache, &mut read_stack).ok();
                let got = rows::step(rule, !address.is_return_address(), &mut ours, &mut read_stack).ok();
                assert_eq!(got, expected, "{rule:?} at {svma:#x} of {:?}, {address:?}", file.id);
                if expected.is_some() {
                    assert_eq!((ours.ip(), ours.sp(), ours.bp()), (theirs.ip(), theirs.sp(), theirs.bp()), "{rule:?} at {svma:#x}");
                }
                compared[usize::from(expected.is_none())] += 1;
            }
        }
    }
    // Thousands of rows stepped both ways, nearly all of them tabulated.
    assert!(compared[0] > 10_000 && compared[2] * 20 < compared[0], "(stepped, stuck or root, left to framehop): {compared:?}");
}

/// What a page's rules are derived from changes with a function tabulated over the page, not with
/// one tabulated elsewhere in its file (publishing would encode the page again for nothing), and
/// once the tables started afresh, whatever the count of functions there.
#[test]
fn a_pages_rules_change_with_the_functions_tabulated_over_it_only() {
    let maps = Maps::read_own().unwrap();
    let files = StackUnwinder::new().mapped_files(std::process::id(), &maps);
    let own = std::env::current_exe().unwrap();
    let code = a_pages_rules_change_with_the_functions_tabulated_over_it_only as *const () as u64;
    let file = files.iter().find(|file| file.avma.contains(&code)).expect("this binary's code is mapped");
    let mapped: Vec<u64> = row_starts(&file.cfi).into_iter().filter(|svma| file.avma.contains(&svma.wrapping_add(file.base_avma))).collect();
    // Two rows a MiB apart: no function of this binary spans that.
    let here = mapped[0];
    let elsewhere = *mapped.iter().find(|&&svma| svma > here + (1 << 20)).unwrap_or_else(|| panic!("{own:?} has code a MiB past its first function"));
    let source_at = |tables: &RuleTables, svma: u64| {
        let page = svma.wrapping_add(file.base_avma) & !(UNWIND_PAGE_SIZE - 1);
        let start = page.wrapping_sub(file.base_avma);
        tables.source_over(file.id, start, start + UNWIND_PAGE_SIZE)
    };
    let mut tables = RuleTables::default();
    let (untouched, empty) = (source_at(&tables, here), source_at(&tables, elsewhere));
    tables.rule(file.id, &file.cfi, elsewhere).expect("a row has a function");
    assert_eq!(source_at(&tables, here), untouched, "a function elsewhere in the file");
    assert_ne!(source_at(&tables, elsewhere), empty, "a function over the page");
    tables.rule(file.id, &file.cfi, here).expect("a row has a function");
    let tabulated = source_at(&tables, here);
    assert_ne!(tabulated, untouched);
    tables.start_afresh();
    tables.rule(file.id, &file.cfi, here).expect("a row has a function");
    assert_ne!(source_at(&tables, here), tabulated, "as many functions, after the tables started afresh");
}

/// The start of every CFI row of every function `cfi`'s `.eh_frame_hdr` lists.
fn row_starts(cfi: &FileCfi) -> Vec<u64> {
    use gimli::{EhFrame, UnwindSection};
    let rows::EhSections { bases, eh_frame, header } = rows::EhSections::of(cfi).expect("a file with .eh_frame_hdr");
    let eh_frame_start = cfi.eh_frame.as_ref().expect("an .eh_frame").0.start;
    let table = header.table().unwrap();
    let mut entries = table.iter(&bases);
    let mut starts = Vec::new();
    let mut context = Box::new(gimli::UnwindContext::new());
    while let Ok(Some((_, fde_at))) = entries.next() {
        let Some(fde_offset) = fde_at.pointer().checked_sub(eh_frame_start) else { continue };
        let Ok(fde) = eh_frame.fde_from_offset(&bases, gimli::EhFrameOffset(fde_offset as usize), EhFrame::cie_from_offset) else { continue };
        let Ok(mut rows) = fde.rows(&eh_frame, &bases, &mut context) else { continue };
        while let Ok(Some(row)) = rows.next_row() {
            starts.push(row.start_address());
        }
    }
    starts
}

/// A stack copy whose words are addresses further up it (so frame-pointer steps move
/// rootwards), mixed by `seed`, with some zero words (roots).
fn synthetic_stack(sp: u64, seed: u64) -> Vec<u64> {
    (0..512u64).map(|word| if (word ^ seed).is_multiple_of(13) { 0 } else { sp + 8 * (word + 1 + (seed.wrapping_mul(word + 7) % 64)) }).collect()
}

thread_local! {
    /// One unwinder for the property tests: it reads this test binary's CFI once.
    static UNWINDER: std::cell::RefCell<Unwinding> = std::cell::RefCell::new(Unwinding::default());
}

fn unwind_shared(pid: u32, snapshot: &Snapshot<'_>) -> Unwound {
    UNWINDER.with(|unwinder| unwinder.borrow_mut().unwind(pid, snapshot))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    /// Garbage stacks and registers: the unwind stops, bounded, without a panic; every frame
    /// base it reports lies above the stack pointer and they only grow.
    #[test]
    fn garbage_stacks_stop_cleanly(stack in proptest::collection::vec(any::<u8>(), 0..4096), ip in any::<u64>(), sp in any::<u64>(), bp in any::<u64>(), own in any::<bool>()) {
        // Our own process has real modules with real CFI; pid 0's maps do not exist.
        let pid = if own { std::process::id() } else { 0 };
        let ip = if own { (unwind_here as *const () as usize as u64).wrapping_add(ip % 256) } else { ip };
        let unwound = unwind_shared(pid, &Snapshot { ip, sp, bp, stack: &stack });
        prop_assert!(unwound.addrs.len() <= MAX_USER_FRAMES);
        prop_assert!(unwound.frame_bases.len() < unwound.addrs.len().max(1));
        prop_assert!(unwound.frame_bases.windows(2).all(|w| w[0] < w[1]));
    }

    /// A stack whose words all point back into itself (a loop) ends.
    #[test]
    fn looping_stacks_end(sp in 0x7000_0000_0000u64..0x7fff_0000_0000, words in 8usize..512) {
        let sp = sp & !7;
        let stack: Vec<u8> = (0..words).flat_map(|_| sp.to_ne_bytes()).collect();
        let ip = unwind_here as *const () as usize as u64;
        let unwound = unwind_shared(std::process::id(), &Snapshot { ip, sp, bp: sp, stack: &stack });
        prop_assert!(!unwound.complete || unwound.addrs.len() <= MAX_USER_FRAMES);
        prop_assert!(unwound.addrs.len() <= words + 1);
    }
}
