use super::layouts::{LAYOUT_3_13, LAYOUT_3_14, LAYOUT_3_15};
use super::*;
use crate::cpython::memory::MemoryImage;

const RUNTIME: u64 = 0x10000;

/// A table in `layout`'s shape: every offset 8, except the GIL's fields, which lie after the GIL.
fn table(layout: &Layout, version: u64) -> Vec<u64> {
    let mut fields = vec![8u64; MAX_FIELDS];
    fields[0] = u64::from_le_bytes(*b"xdebugpy");
    fields[1] = version;
    fields[layout.free_threaded] = 0;
    for size in [
        layout.runtime_size,
        layout.interp_size,
        layout.tstate_size,
        layout.frame_size,
        layout.code_size,
        layout.bytes_size,
        layout.unicode_size,
        layout.object_size,
        layout.type_size,
    ] {
        fields[size] = 256;
    }
    if let Some(o) = &layout.objects {
        for size in [o.set_size, o.long_size, o.gen_size] {
            fields[size] = 256;
        }
    }
    fields[layout.interp_gil] = 64;
    fields[layout.gil_locked] = 72;
    fields[layout.gil_holder] = 80;
    // As in every GIL build: `co_version` at 92.
    fields[layout.code_firstlineno] = 68;
    fields[layout.code_localsplusnames] = 96;
    fields
}

fn read(fields: &[u64]) -> Result<DebugOffsets, PyError> {
    let mut image = MemoryImage::default();
    image.insert(RUNTIME, fields.iter().flat_map(|f| f.to_le_bytes()).collect());
    read_debug_offsets(&image, RUNTIME)
}

#[test]
fn accepts_known_layouts() {
    for (layout, version) in [(&LAYOUT_3_13, 0x030d00f0), (&LAYOUT_3_14, 0x030e0af0), (&LAYOUT_3_15, 0x030f00b4), (&LAYOUT_3_15, 0x030f02f0)] {
        let offsets = read(&table(layout, version)).unwrap();
        assert_eq!((offsets.gil_locked, offsets.gil_holder), (8, 16), "GIL fields relative to the GIL");
        assert_eq!(offsets.objects.is_some(), layout.objects.is_some(), "asyncio's object offsets from 3.14 on");
    }
}

/// Asserts that each named offset of `$read` is the one its layout `$layout` places under that name.
macro_rules! assert_read_by_name {
    ($read:expr, $layout:expr, [$($field:ident),* $(,)?]) => {
        $(assert_eq!($read.$field, $layout.$field as u64, "{} read from another field", stringify!($field));)*
    };
}

/// A table whose every offset is its own position in the table: each offset read tells which
/// field it was read from, so one read from another field's position shows.
#[test]
fn each_offset_is_read_from_the_field_of_its_name() {
    for (l, version) in [(&LAYOUT_3_13, 0x030d00f0), (&LAYOUT_3_14, 0x030e00f0), (&LAYOUT_3_15, 0x030f00f0)] {
        let mut fields = table(l, version);
        for (index, field) in fields.iter_mut().enumerate() {
            if *field == 8 {
                *field = index as u64;
            }
        }
        if let Some(o) = &l.objects {
            fields[o.llist_next] = 8;
        }
        fields[l.code_firstlineno] = l.code_firstlineno as u64;
        fields[l.code_localsplusnames] = l.code_firstlineno as u64 + 28;
        let read = read(&fields).unwrap();
        assert_eq!(read.code_identity, CodeIdentity::Version(l.code_firstlineno as u64 + 24));
        assert_ne!(read.interp_id, read.interp_next, "two fields, two values");
        #[rustfmt::skip]
        assert_read_by_name!(read, l, [
            interpreters_head, interp_id, interp_next, interp_threads_head, interp_ceval_gil,
            tstate_prev, tstate_next, tstate_interp, tstate_current_frame, tstate_native_thread_id,
            frame_previous, frame_executable, frame_instr_ptr,
            code_filename, code_qualname, code_linetable, code_firstlineno, code_adaptive,
            object_type, type_name, bytes_ob_size, bytes_data, unicode_state, unicode_length, unicode_ascii_size,
        ]);
        let position = |index: Option<usize>| index.map(|index| index as u64);
        assert_eq!(read.tstate_status, position(Some(l.tstate_status)));
        assert_eq!(read.frame_owner, position(Some(l.frame_owner)));
        assert_eq!(read.code_object_generation, position(l.code_object_generation));
        assert_eq!(read.tstate_last_profiled_frame, position(l.tstate_last_profiled_frame));
        assert_eq!(read.tstate_last_profiled_seq, position(l.tstate_last_profiled_seq));
        let compact = l.unicode_compact_size.map_or(l.unicode_ascii_size as u64 + COMPACT_UTF8_FIELDS, |index| index as u64);
        assert_eq!(read.unicode_compact_size, compact);
        if let (Some(read), Some(o)) = (&read.objects, &l.objects) {
            #[rustfmt::skip]
            assert_read_by_name!(read, o, [
                frame_stackpointer, type_flags, set_used, set_table, set_mask,
                long_tag, long_digits, gen_iframe, gen_frame_state,
            ]);
        }
    }
}

/// 3.11 flags the first frame of an activation; later versions push an entry frame of their own.
#[test]
fn frames_are_told_apart_by_owner_and_entry_flag() {
    use crate::chain::LinkKind;
    use pyebpf_common::ENTRY_FLAG;
    let v3_11 = builtin_offsets(PyVersion(0x030b07f0)).unwrap();
    let v3_12 = builtin_offsets(PyVersion(0x030c01f0)).unwrap();
    assert_eq!(
        [0, 1, 2, ENTRY_FLAG, 2 | ENTRY_FLAG].map(|owner| v3_11.link_kind(owner)),
        [LinkKind::Code, LinkKind::Code, LinkKind::Code, LinkKind::EntryCode, LinkKind::EntryCode]
    );
    assert_eq!([0, 2, 3, 4].map(|owner| v3_12.link_kind(owner)), [LinkKind::Code, LinkKind::Code, LinkKind::Entry, LinkKind::Entry]);
    assert!(builtin_offsets(PyVersion(0x030b00c1)).is_none(), "a 3.11 release candidate's layout is not known");
    assert!(builtin_offsets(PyVersion(0x030a0df0)).is_none(), "3.10 has no table");
}

#[test]
fn refuses_unknown_versions_and_free_threading() {
    assert!(matches!(read(&table(&LAYOUT_3_13, 0x030c00f0)), Err(PyError::UnsupportedVersion(_))));
    assert!(matches!(read(&table(&LAYOUT_3_15, 0x030f00b3)), Err(PyError::UnsupportedVersion(_))));
    assert!(matches!(read(&table(&LAYOUT_3_15, 0x031000f0)), Err(PyError::UnsupportedVersion(_))));
    let mut free_threaded = table(&LAYOUT_3_14, 0x030e00f0);
    free_threaded[LAYOUT_3_14.free_threaded] = 1;
    assert!(matches!(read(&free_threaded), Err(PyError::FreeThreaded(_))), "3.14t's thread-local bytecode is not read");
    let mut bad_link = table(&LAYOUT_3_14, 0x030e00f0);
    bad_link[LAYOUT_3_14.objects.as_ref().unwrap().llist_next] = 12;
    assert!(matches!(read(&bad_link), Err(PyError::BadOffsets(_))), "a list link inside no two-pointer node");
    let mut no_cookie = table(&LAYOUT_3_14, 0x030e00f0);
    no_cookie[0] = 0;
    assert!(matches!(read(&no_cookie), Err(PyError::NoDebugOffsets)));
}

/// 3.13t: its own offsets (a larger object header) come from its table; `co_version` from them.
#[test]
fn reads_free_threaded_3_13_from_its_own_table() {
    let mut fields = table(&LAYOUT_3_13, 0x030d0ff0);
    assert!(!read(&fields).unwrap().free_threaded);
    fields[LAYOUT_3_13.free_threaded] = 1;
    fields[LAYOUT_3_13.code_firstlineno] = 84;
    fields[LAYOUT_3_13.code_localsplusnames] = 112;
    let offsets = read(&fields).unwrap();
    assert!(offsets.free_threaded);
    assert_eq!(offsets.code_identity, CodeIdentity::Version(108));
}

#[test]
fn refuses_a_code_object_whose_co_version_the_table_does_not_place() {
    let mut fields = table(&LAYOUT_3_15, 0x030f02f0);
    fields[LAYOUT_3_15.code_localsplusnames] = 104;
    assert!(matches!(read(&fields), Err(PyError::BadOffsets(_))));
}

#[test]
fn refuses_implausible_offsets_and_sizes() {
    let l = &LAYOUT_3_14;
    for (field, value) in
        [(l.frame_previous, 256), (l.code_qualname, u64::MAX), (l.frame_size, 0), (l.code_size, 1 << 20), (l.type_name, 4096), (l.gil_locked, 8)]
    {
        let mut fields = table(l, 0x030e00f0);
        fields[field] = value;
        assert!(matches!(read(&fields), Err(PyError::BadOffsets(_))), "field {field} = {value} accepted");
    }
}
