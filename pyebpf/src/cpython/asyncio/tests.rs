use super::*;

fn table(fields: [u64; TABLE_FIELDS]) -> Vec<u8> {
    fields.iter().flat_map(|field| field.to_le_bytes()).collect()
}

/// As CPython 3.15.0 lays it out.
const REAL: [u64; TABLE_FIELDS] = [168, 136, 96, 108, 109, 128, 152, 226_240, 10_856, 1104, 1024, 1032, 1048];

#[test]
fn real_table_is_accepted() {
    let offsets = AsyncioOffsets::from_table(&table(REAL)).unwrap();
    assert_eq!((offsets.task_coro, offsets.task_node, offsets.thread_running_task), (128, 152, 1032));
}

#[test]
fn implausible_tables_are_refused() {
    for (field, value) in [(0, 0), (0, 1 << 20), (6, 160), (1, u64::MAX), (9, 0), (12, 1100), (8, 226_240)] {
        let mut fields = REAL;
        fields[field] = value;
        assert!(AsyncioOffsets::from_table(&table(fields)).is_err(), "field {field} = {value} accepted");
    }
    assert!(AsyncioOffsets::from_table(&table(REAL)[..40]).is_err(), "a short table is read as zeros and refused");
}

use crate::cpython::memory::MemoryImage;
use crate::cpython::offsets::{builtin_offsets, FrameStates, ObjectOffsets, PyVersion};

const TSTATE: u64 = 0x20000;
const STR_TYPE: u64 = 0x30000;
const NAME: u64 = 0x31000;
const SET: u64 = 0x40000;

/// A process image with 3.12's object offsets plus made-up asyncio ones, a thread state
/// whose task list holds `tasks` (task addresses, linked in order and then to `last_next`),
/// each named "t" and awaited by the set at `SET`.
fn image(tasks: &[u64], last_next: u64, set_mask: u64) -> PyProcess<MemoryImage> {
    let t = AsyncioOffsets::from_table(&table(REAL)).unwrap();
    let mut mem = MemoryImage::default();
    let node = |task: u64| task + t.task_node;
    let mut tstate = vec![0u8; 1104];
    let first = tasks.first().map_or(TSTATE + t.thread_tasks_head, |&task| node(task));
    tstate[t.thread_tasks_head as usize..][..8].copy_from_slice(&first.to_le_bytes());
    mem.insert(TSTATE, tstate);
    for (i, &task) in tasks.iter().enumerate() {
        let mut raw = vec![0u8; t.task_size as usize];
        let next = tasks.get(i + 1).map_or(last_next, |&next| node(next));
        raw[t.task_node as usize..][..8].copy_from_slice(&next.to_le_bytes());
        raw[t.task_name as usize..][..8].copy_from_slice(&NAME.to_le_bytes());
        raw[t.task_awaited_by as usize..][..8].copy_from_slice(&SET.to_le_bytes());
        raw[t.task_is_task as usize] = 1;
        raw[t.task_awaited_by_is_set as usize] = 1;
        mem.insert(task, raw);
    }
    let mut ty = vec![0u8; 256];
    ty[168..176].copy_from_slice(&UNICODE_SUBCLASS.to_le_bytes());
    mem.insert(STR_TYPE, ty);
    // A compact ASCII str of one character (3.12's header: 40 bytes).
    let mut name = vec![0u8; 48];
    name[8..16].copy_from_slice(&STR_TYPE.to_le_bytes());
    name[16] = 1;
    name[32] = 1 << 2 | 1 << 5 | 1 << 6;
    name[40] = b't';
    mem.insert(NAME, name);
    let mut set = vec![0u8; 64];
    set[24] = 1;
    set[32..40].copy_from_slice(&set_mask.to_le_bytes());
    set[40..48].copy_from_slice(&(SET + 48).to_le_bytes());
    mem.insert(SET, set);
    let mut offsets = builtin_offsets(PyVersion(0x030c01f0)).unwrap();
    offsets.objects = Some(ObjectOffsets {
        frame_stackpointer: 64,
        type_flags: 168,
        set_used: 24,
        set_mask: 32,
        set_table: 40,
        long_tag: 16,
        long_digits: 24,
        gen_iframe: 80,
        gen_frame_state: 67,
        llist_next: 0,
        states: FrameStates { created: 0, suspended: &[1, 2, 3], yield_from: &[2, 3], executing: 4 },
        awaited_below_top: 16,
    });
    PyProcess::with_offsets(1, mem, 0, offsets)
}

#[test]
fn a_looping_task_list_is_an_error() {
    let mut process = image(&[0x10000, 0x11000], 0x10000 + 152, 0);
    let mut reader = TaskReader::new(&mut process, AsyncioOffsets::from_table(&table(REAL)).ok(), 10).unwrap();
    let err = reader.thread_tasks(TSTATE).unwrap_err();
    assert!(err.to_string().contains("loops"), "{err}");
}

#[test]
fn tasks_past_the_budget_are_counted_up_to_a_bound() {
    // A loop past the one task read: counted, never followed for ever.
    let mut process = image(&[0x10000, 0x11000], 0x10000 + 152, 0);
    let mut reader = TaskReader::new(&mut process, AsyncioOffsets::from_table(&table(REAL)).ok(), 1).unwrap();
    let list = reader.thread_tasks(TSTATE).unwrap();
    assert_eq!((list.tasks.len(), list.total, list.more), (1, 1 + MAX_COUNTED, true));
    assert_eq!(list.tasks[0].name, "t");
    assert_eq!(list.tasks[0].error, None);
    let mut process = image(&[0x10000, 0x11000, 0x12000], TSTATE + 1048, 0);
    let mut reader = TaskReader::new(&mut process, AsyncioOffsets::from_table(&table(REAL)).ok(), 2).unwrap();
    let list = reader.thread_tasks(TSTATE).unwrap();
    assert_eq!((list.tasks.len(), list.total, list.more), (2, 3, false));
}

#[test]
fn an_implausible_set_of_awaiters_is_the_task_s_error() {
    let mut process = image(&[0x10000], TSTATE + 1048, 1 << 40);
    let mut reader = TaskReader::new(&mut process, AsyncioOffsets::from_table(&table(REAL)).ok(), 10).unwrap();
    let list = reader.thread_tasks(TSTATE).unwrap();
    let error = list.tasks[0].error.as_deref().unwrap_or_default();
    assert!(error.contains("set of awaiters"), "{error}");
}

/// Two coroutines awaiting each other: the chain is an error of the task, not a hang.
#[test]
fn a_looping_coroutine_chain_is_the_task_s_error() {
    const A: u64 = 0x50000;
    const B: u64 = 0x51000;
    let mut process = image(&[0x10000], TSTATE + 1048, 0);
    let t = AsyncioOffsets::from_table(&table(REAL)).unwrap();
    let mem = &mut process.mem;
    mem.range_mut(0x10000).unwrap()[t.task_coro as usize..][..8].copy_from_slice(&A.to_le_bytes());
    for (coro, awaits) in [(A, B), (B, A)] {
        let mut raw = vec![0u8; 512];
        raw[8..16].copy_from_slice(&0x5000u64.to_le_bytes());
        // Suspended in `await` (3.15's numbering, as `image` sets it).
        raw[67] = 2;
        // The frame at +80 runs no code object; its stack top is at +400, the awaited one below it.
        raw[144..152].copy_from_slice(&(coro + 400).to_le_bytes());
        raw[384..392].copy_from_slice(&awaits.to_le_bytes());
        mem.insert(coro, raw);
    }
    let mut reader = TaskReader::new(&mut process, Some(t), 10).unwrap();
    let list = reader.thread_tasks(TSTATE).unwrap();
    let error = list.tasks[0].error.as_deref().unwrap_or_default();
    assert!(error.contains("coroutine chain loops"), "{error}");
}

#[test]
fn versions_without_object_offsets_and_processes_without_the_table_are_refused() {
    let mut process = image(&[], 0, 0);
    assert!(matches!(TaskReader::new(&mut process, None, 10), Err(AsyncioError::NotImported(1))));
    let mut old = PyProcess::with_offsets(1, MemoryImage::default(), 0, builtin_offsets(PyVersion(0x030c01f0)).unwrap());
    assert!(matches!(TaskReader::new(&mut old, AsyncioOffsets::from_table(&table(REAL)).ok(), 10), Err(AsyncioError::TooOld { .. })));
}

fn captured(flags: u64, len: u64, state: u32, bytes: &[u8]) -> TaskRecord {
    let mut name = [0u8; TASK_NAME_BYTES];
    name[..bytes.len()].copy_from_slice(bytes);
    TaskRecord { task: 1, coro_frame: 2, awaited_by: 0, name_flags: flags, name_len: len, name_state: state, frames_len: 0, name }
}

fn objects() -> ObjectOffsets {
    image(&[], TSTATE, 0).offsets().objects.clone().unwrap()
}

/// State words of compact strings: ASCII, and UCS-2.
const ASCII: u32 = 1 << 2 | 1 << 5 | 1 << 6;
const UCS2: u32 = 2 << 2 | 1 << 5;

#[test]
fn captured_names_are_decoded_and_long_ones_marked_cut() {
    let o = objects();
    assert_eq!(captured_name(&captured(UNICODE_SUBCLASS, 6, ASCII, b"busy-1"), &o).unwrap(), "busy-1");
    let long = [b'x'; TASK_NAME_BYTES];
    assert_eq!(captured_name(&captured(UNICODE_SUBCLASS, 100, ASCII, &long), &o).unwrap(), format!("{}…", "x".repeat(TASK_NAME_BYTES)));
    let wide: Vec<u8> = "tâche-π".encode_utf16().flat_map(u16::to_le_bytes).collect();
    assert_eq!(captured_name(&captured(UNICODE_SUBCLASS, 7, UCS2, &wide), &o).unwrap(), "tâche-π");
    // Task-40000: two 30-bit digits would be needed past 2^30; one here, after an 8-byte tag.
    let mut int = (1u64 << 3).to_le_bytes().to_vec();
    int.extend(40_000u32.to_le_bytes());
    assert_eq!(captured_name(&captured(LONG_SUBCLASS, 0, 0, &int), &o).unwrap(), "Task-40000");
}

#[test]
fn captured_names_that_are_neither_strings_nor_small_ints_are_errors() {
    let o = objects();
    assert!(captured_name(&captured(0, 0, 0, b""), &o).is_err(), "a name not read");
    assert!(captured_name(&captured(UNICODE_SUBCLASS, 3, 0, b"abc"), &o).is_err(), "a string not compact");
    let negative = (1u64 << 3 | 2).to_le_bytes();
    assert!(captured_name(&captured(LONG_SUBCLASS, 0, 0, &negative), &o).is_err(), "a negative number");
}

#[test]
fn the_bpf_config_fills_unused_state_slots_with_the_first() {
    let process = image(&[], TSTATE, 0);
    let config = bpf_config(&AsyncioOffsets::from_table(&table(REAL)).unwrap(), process.offsets()).unwrap();
    assert_eq!((config.suspended_states, config.yield_from_states), ([1, 2, 3, 1], [2, 3, 2, 2]));
    assert_eq!((config.thread_running_task, config.task_coro, config.gen_iframe), (1032, 128, 80));
}
