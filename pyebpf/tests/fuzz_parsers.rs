//! Fuzzing the parsers of outside bytes other than the CPython reader (`fuzz_reader`): the records
//! the eBPF program sends through the ring buffer, the kernel's BTF, the ELF lookup of
//! `_PyRuntime` in a mapped interpreter, and the call frame information (CFI) stack copies are
//! unwound with. Inputs are arbitrary bytes and mutated copies of real ones (the running kernel's
//! BTF, Debian's python3.14 and python3.13 executables). Any outcome is fine except a
//! panic, a hang or an unbounded allocation; what a parser accepts must also be consistent.
//! `PYEBPF_FUZZ_CASES` scales the number of cases like `fuzz_reader` (default 800 000: the records
//! get a quarter of them; BTF and ELF, whose inputs are megabytes, one in 200: about 30 s each;
//! CFI one in 100, about 5 s).

use std::cell::Cell;
use std::mem::{offset_of, size_of};

use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};
use pyebpf::cpython::runtime::runtime_in_elf;
use pyebpf::kernel_btf::Btf;
use pyebpf::reader::{Record, RecordBatch};
use pyebpf::unwind::{unwind_in_image, Snapshot};
use pyebpf_common::{record_kind, OffCpuEnd, ProcessEvent, SampleRecord, TaskRecord, WaitingTasks, MAX_KERNEL_FRAMES, MAX_TASKS, MAX_USER_FRAMES};

fn cases() -> u32 {
    std::env::var("PYEBPF_FUZZ_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(800_000)
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(ProptestConfig { cases: cases.max(1), failure_persistence: None, ..ProptestConfig::default() })
}

/// Changes to a copy of a real input: bytes overwritten at chosen offsets (as fractions of the
/// length, so every region is reached), then possibly cut short.
#[derive(Debug, Clone)]
struct Mutation {
    writes: Vec<(f64, Vec<u8>)>,
    /// Fraction of the length kept, or None for all of it.
    truncate: Option<f64>,
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let write = (prop_oneof![0.0..0.001f64, 0.0..1.0f64], prop::collection::vec(any::<u8>(), 1..9));
    (prop::collection::vec(write, 1..6), prop::option::weighted(0.2, 0.0..1.0f64)).prop_map(|(writes, truncate)| Mutation { writes, truncate })
}

fn apply(original: &[u8], mutation: &Mutation) -> Vec<u8> {
    let mut data = original.to_vec();
    for (at, bytes) in &mutation.writes {
        let start = ((data.len() as f64 * at) as usize).min(data.len());
        let end = (start + bytes.len()).min(data.len());
        data[start..end].copy_from_slice(&bytes[..end - start]);
    }
    if let Some(keep) = mutation.truncate {
        data.truncate((data.len() as f64 * keep) as usize);
    }
    data
}

/// A sample record's bytes as the eBPF program sends them, with `frames` Python frames.
fn sample_bytes(frames: usize, frames_len: u32) -> Vec<u8> {
    // SAFETY: SampleRecord is plain data; all-zero bytes are a valid value.
    let mut record: Box<SampleRecord> = unsafe { Box::new_zeroed().assume_init() };
    record.kind = record_kind::SAMPLE;
    record.py.frames_len = frames_len;
    // SAFETY: reading the bytes of a plain-data value.
    let bytes = unsafe { std::slice::from_raw_parts(&*record as *const SampleRecord as *const u8, size_of::<SampleRecord>()) };
    bytes[..SampleRecord::sent_len(frames, 0).min(bytes.len())].to_vec()
}

/// Arbitrary ring-buffer records: a kind (mostly a real one) and bytes of any length up to past a
/// whole record, or a well-formed sample whose frame count disagrees with its length. A decoded
/// sample always has as many frames as its length holds.
#[test]
fn ring_buffer_records_never_panic_and_decode_consistently() {
    let kinds = prop_oneof![Just(record_kind::SAMPLE), Just(record_kind::EXEC), Just(record_kind::EXIT), Just(record_kind::OFF_CPU_END), any::<u32>()];
    let arbitrary = (kinds, prop::collection::vec(any::<u8>(), 0..size_of::<SampleRecord>() + 64)).prop_map(|(kind, mut bytes)| {
        if bytes.len() >= 4 {
            bytes[..4].copy_from_slice(&kind.to_ne_bytes());
        }
        bytes
    });
    let shaped = (0..pyebpf_common::MAX_PY_FRAMES + 2, prop_oneof![Just(None), any::<u32>().prop_map(Some)])
        .prop_map(|(frames, claimed)| sample_bytes(frames, claimed.unwrap_or(frames as u32)));
    let event = (prop_oneof![Just(record_kind::EXEC), Just(record_kind::EXIT)], prop::collection::vec(any::<u8>(), size_of::<ProcessEvent>())).prop_map(
        |(kind, mut bytes)| {
            bytes[..4].copy_from_slice(&kind.to_ne_bytes());
            bytes
        },
    );
    let end = prop::collection::vec(any::<u8>(), size_of::<OffCpuEnd>()).prop_map(|mut bytes| {
        bytes[..4].copy_from_slice(&record_kind::OFF_CPU_END.to_ne_bytes());
        bytes
    });
    let waiting = prop::collection::vec(any::<u8>(), size_of::<WaitingTasks>()).prop_map(|mut bytes| {
        bytes[..4].copy_from_slice(&record_kind::WAITING_TASKS.to_ne_bytes());
        bytes
    });
    let decoded: [Cell<u64>; 5] = Default::default();
    runner(cases() / 4)
        .run(&prop_oneof![arbitrary, shaped, event, end, waiting], |bytes| {
            let mut batch = RecordBatch::from_items([&bytes[..]]);
            match batch.next() {
                Some(Record::Sample(sample)) => {
                    prop_assert_eq!(SampleRecord::sent_len(sample.frames_sent(), sample.stack_len as usize), bytes.len());
                    prop_assert!(bytes.len() <= size_of::<SampleRecord>());
                    decoded[0].set(decoded[0].get() + 1);
                }
                Some(Record::Event(event)) => {
                    prop_assert!(event.kind == record_kind::EXEC || event.kind == record_kind::EXIT);
                    decoded[1].set(decoded[1].get() + 1);
                }
                Some(Record::OffCpuEnd(end)) => {
                    prop_assert_eq!(end.kind, record_kind::OFF_CPU_END);
                    prop_assert_eq!(bytes.len(), size_of::<OffCpuEnd>());
                    decoded[3].set(decoded[3].get() + 1);
                }
                Some(Record::WaitingTasks(waiting)) => {
                    prop_assert_eq!(waiting.kind, record_kind::WAITING_TASKS);
                    prop_assert_eq!(bytes.len(), size_of::<WaitingTasks>());
                    decoded[4].set(decoded[4].get() + 1);
                }
                None => decoded[2].set(decoded[2].get() + 1),
            }
            Ok(())
        })
        .unwrap();
    let decoded = decoded.map(Cell::into_inner);
    eprintln!("records: {} samples, {} events, {} interval ends, {} waiting tasks, {} rejected", decoded[0], decoded[1], decoded[3], decoded[4], decoded[2]);
    assert!(decoded.iter().all(|&n| n > 0), "the generator never reached every outcome: {decoded:?}");
    // A sample of every frame count the program sends decodes.
    for frames in [0, 1, pyebpf_common::MAX_PY_FRAMES] {
        let bytes = sample_bytes(frames, frames as u32);
        assert!(matches!(RecordBatch::from_items([&bytes[..]]).next(), Some(Record::Sample(_))), "{frames} frames");
    }
}

/// The reader keeps only the used entries of a sample's stacks and task chain: whatever lengths a
/// sample has, it decodes to what was sent (every scalar, every used entry, the Python frames and
/// the stack copy), and a second sample decoded into the same record does too.
#[test]
fn packed_samples_decode_to_what_was_sent() {
    let lengths = (0..=MAX_USER_FRAMES as u32, 0..=MAX_USER_FRAMES as u32, 0..=MAX_KERNEL_FRAMES as u32, 0..=MAX_TASKS as u32, 0..40usize, 0..300usize);
    let sample = (lengths, any::<u64>()).prop_map(|((user, bases, kernel, tasks, frames, stack), seed)| {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut bytes: Vec<u8> = std::iter::repeat_with(|| rng.u8(..)).take(SampleRecord::sent_len(frames, stack)).collect();
        let header = &mut bytes[..SampleRecord::HEADER_LEN];
        let mut set = |offset: usize, value: u32| header[offset..offset + 4].copy_from_slice(&value.to_ne_bytes());
        set(offset_of!(SampleRecord, kind), record_kind::SAMPLE);
        set(offset_of!(SampleRecord, user_len), user);
        set(offset_of!(SampleRecord, frame_bases_len), bases);
        set(offset_of!(SampleRecord, kernel_len), kernel);
        set(offset_of!(SampleRecord, stack_len), stack as u32);
        set(offset_of!(SampleRecord, py.frames_len), frames as u32);
        set(offset_of!(SampleRecord, tasks.len), tasks);
        set(offset_of!(SampleRecord, tasks.frames_len), 0);
        bytes
    });
    runner(cases() / 400)
        .run(&(sample.clone(), sample), |(first, second)| {
            let mut batch = RecordBatch::from_items([&first[..], &second[..]]);
            for sent in [&first, &second] {
                let Some(Record::Sample(decoded)) = batch.next() else { panic!("a well-formed sample was not decoded") };
                // SAFETY: reading the bytes of a plain-data value.
                let decoded_bytes = unsafe { std::slice::from_raw_parts(decoded as *const SampleRecord as *const u8, size_of::<SampleRecord>()) };
                let user = (decoded.user_len as usize).max(1) * 8;
                let parts = [
                    0..offset_of!(SampleRecord, user_stack),
                    offset_of!(SampleRecord, user_stack)..offset_of!(SampleRecord, user_stack) + user,
                    offset_of!(SampleRecord, user_frame_bases)..offset_of!(SampleRecord, user_frame_bases) + decoded.frame_bases_len as usize * 8,
                    offset_of!(SampleRecord, kernel_stack)..offset_of!(SampleRecord, kernel_stack) + decoded.kernel_len as usize * 8,
                    offset_of!(SampleRecord, tasks)..offset_of!(SampleRecord, tasks.tasks) + decoded.tasks.len as usize * size_of::<TaskRecord>(),
                    SampleRecord::HEADER_LEN..SampleRecord::sent_len(decoded.frames_sent(), 0),
                ];
                for part in parts {
                    prop_assert_eq!(&decoded_bytes[part.clone()], &sent[part.clone()], "bytes {:?} differ", part);
                }
                let stack = &sent[SampleRecord::sent_len(decoded.frames_sent(), 0)..];
                prop_assert_eq!(&decoded.stack_tail[..decoded.stack_len as usize], stack);
            }
            Ok(())
        })
        .unwrap();
}

/// Mutated copies of the running kernel's BTF, and short blobs behind a valid magic: parsing and
/// the member lookup pyebpf makes (`task_struct.tgid`) never panic.
#[test]
fn kernel_btf_parser_survives_mutated_and_random_blobs() {
    let original = std::fs::read("/sys/kernel/btf/vmlinux").expect("the kernel's BTF (/sys/kernel/btf/vmlinux)");
    let btf = Btf::parse(&original).expect("the unmutated BTF parses");
    btf.member_offset("task_struct", "tgid").expect("task_struct.tgid in the unmutated BTF");
    let outcomes: [Cell<u64>; 2] = Default::default();
    runner(cases() / 200)
        .run(&mutation(), |mutation| {
            let data = apply(&original, &mutation);
            match Btf::parse(&data) {
                Ok(btf) => {
                    let _ = btf.member_offset("task_struct", "tgid");
                    let _ = btf.member_offset("task_struct", "no_such_member");
                    outcomes[0].set(outcomes[0].get() + 1);
                }
                Err(_) => outcomes[1].set(outcomes[1].get() + 1),
            }
            Ok(())
        })
        .unwrap();
    eprintln!("BTF mutations: {} parsed, {} rejected", outcomes[0].get(), outcomes[1].get());
    let blob = prop::collection::vec(any::<u8>(), 0..512).prop_map(|mut bytes| {
        // Magic 0xeb9f, version 1: past the first check, into the header's offsets.
        if bytes.len() >= 4 {
            bytes[..4].copy_from_slice(&[0x9f, 0xeb, 1, 0]);
        }
        bytes
    });
    runner(cases() / 40)
        .run(&blob, |data| {
            if let Ok(btf) = Btf::parse(&data) {
                let _ = btf.member_offset("task_struct", "tgid");
            }
            Ok(())
        })
        .unwrap();
}

/// The bytes of a test interpreter's executable, `usr/bin/NAME` under `PYEBPF_PYTHONS`.
fn test_python(name: &str) -> Vec<u8> {
    std::fs::read(pyebpf_tests::test_pythons().join("usr/bin").join(name)).unwrap()
}

/// Mutated copies of Debian's python3.14 executable (headers, section and program tables, and the
/// rest): the lookup of `_PyRuntime` and `Py_Version` never panics.
#[test]
fn elf_runtime_lookup_survives_mutated_executables() {
    let original = test_python("python3.14");
    let elf = runtime_in_elf(original.as_slice(), 0x5555_5555_4000).expect("the unmutated executable parses");
    assert!(elf.runtime.is_some_and(|address| address > 0x5555_5555_4000) && elf.version.is_some() && elf.embeds_python, "{elf:?}");
    // Where the section header table is: mutations there reach the section lookup.
    let shoff = u64::from_le_bytes(original[0x28..0x30].try_into().unwrap()) as f64 / original.len() as f64;
    let near_sections = (shoff..1.0f64, prop::collection::vec(any::<u8>(), 1..9));
    let strategy = (mutation(), prop::option::of(near_sections)).prop_map(|(mut mutation, extra)| {
        mutation.writes.extend(extra);
        mutation
    });
    let outcomes: [Cell<u64>; 2] = Default::default();
    runner(cases() / 200)
        .run(&strategy, |mutation| {
            let data = apply(&original, &mutation);
            match runtime_in_elf(data.as_slice(), 0x5555_5555_4000) {
                Some(elf) if elf.runtime.is_some() => outcomes[0].set(outcomes[0].get() + 1),
                _ => outcomes[1].set(outcomes[1].get() + 1),
            }
            Ok(())
        })
        .unwrap();
    eprintln!("ELF mutations: {} found a runtime, {} did not", outcomes[0].get(), outcomes[1].get());
}

/// Where the CFI fuzzers map an image.
const IMAGE_START: u64 = 0x5555_5555_0000;

/// Debian's python3.13 (built without frame pointers, so its samples are CFI-unwound) with its
/// `.eh_frame` and `.eh_frame_hdr` mutated, unwinding stacks of random words and return addresses
/// into its code. An unwind must end (the frame bound holds) and never panic.
#[test]
fn cfi_unwinding_survives_mutated_unwind_sections_and_random_stacks() {
    use object::{Object, ObjectSection};
    let original = test_python("python3.13");
    let (text, unwind_sections) = {
        let elf = object::File::parse(original.as_slice()).unwrap();
        let range = |name: &str| {
            let (offset, size) = elf.section_by_name(name).unwrap().file_range().unwrap();
            offset as f64 / original.len() as f64..(offset + size) as f64 / original.len() as f64
        };
        let text = elf.section_by_name(".text").unwrap();
        (text.address()..text.address() + text.size(), [range(".eh_frame_hdr"), range(".eh_frame")])
    };
    let return_address = (text.start..text.end).prop_map(|at| IMAGE_START + at);
    let word = prop_oneof![any::<u64>(), return_address.clone(), (0u64..4096).prop_map(|n| 0x7ffd_0000_0000 + n * 8)];
    let in_sections = prop_oneof![unwind_sections[0].clone(), unwind_sections[1].clone()];
    let writes = prop::collection::vec((in_sections, prop::collection::vec(any::<u8>(), 1..9)), 0..8);
    let strategy = (mutation(), writes, return_address, prop::collection::vec(word, 0..512), any::<u64>());
    let unwound = Cell::new(0u64);
    let frames = Cell::new(0u64);
    runner(cases() / 100)
        .run(&strategy, |(mut mutation, section_writes, ip, words, bp)| {
            mutation.writes.extend(section_writes);
            mutation.truncate = None;
            let image = apply(&original, &mutation);
            let stack: Vec<u8> = words.iter().flat_map(|word| word.to_le_bytes()).collect();
            let snapshot = Snapshot { ip, sp: 0x7ffd_0000_0000, bp, stack: &stack };
            if let Some(result) = unwind_in_image(&image, IMAGE_START, &snapshot) {
                prop_assert!(result.addrs.len() <= MAX_USER_FRAMES, "{} frames", result.addrs.len());
                prop_assert!(result.frame_bases.len() <= result.addrs.len());
                unwound.set(unwound.get() + 1);
                frames.set(frames.get() + result.addrs.len() as u64);
            }
            Ok(())
        })
        .unwrap();
    eprintln!("CFI: {} unwinds, {} frames", unwound.get(), frames.get());
    assert!(unwound.get() > 0, "no mutated image parsed: the fuzzer reached no unwinding");
}

/// What the CFI fuzzer found first: an `.eh_frame_hdr` whose `eh_frame_ptr` lies past the FDEs it
/// indexes makes gimli subtract past zero (unchecked; it wraps as shipped, into an offset the next
/// read rejects). Kept as a regression input: the unwind ends at the sampled instruction.
#[test]
fn an_eh_frame_hdr_pointing_past_its_fdes_stops_the_unwind() {
    use object::{Object, ObjectSection};
    let mut image = test_python("python3.13");
    let (hdr, text) = {
        let elf = object::File::parse(image.as_slice()).unwrap();
        let (hdr, _) = elf.section_by_name(".eh_frame_hdr").unwrap().file_range().unwrap();
        (hdr as usize, elf.section_by_name(".text").unwrap().address())
    };
    let ip = IMAGE_START + text + 0x100;
    // A stack of return addresses into the code: the intact image unwinds through some of them.
    let stack: Vec<u8> = (0..64).flat_map(|_| (IMAGE_START + text + 0x200).to_le_bytes()).collect();
    let snapshot = Snapshot { ip, sp: 0x7ffd_0000_0000, bp: 0, stack: &stack };
    let intact = unwind_in_image(&image, IMAGE_START, &snapshot).unwrap();
    assert!(intact.addrs.len() > 1, "the intact image does not unwind: {intact:?}");
    // eh_frame_ptr (after version and three encodings), pc-relative sdata4: far past every FDE.
    assert_eq!(image[hdr], 1, "an .eh_frame_hdr of version 1");
    image[hdr + 4..hdr + 8].copy_from_slice(&0x7fff_0000i32.to_le_bytes());
    let unwound = unwind_in_image(&image, IMAGE_START, &snapshot).expect("the image still parses");
    assert_eq!(unwound.addrs, vec![ip], "{unwound:?}");
}
