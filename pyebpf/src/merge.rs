//! Merging a sample's native stack with its Python stack.
//!
//! Since CPython 3.11 a Python-to-Python call does not recurse in C: one interpreter activation
//! runs a whole *segment* of Python frames, and a new activation starts only when C code calls back
//! into Python. Each activation keeps an entry frame as a local on its own C stack frame, and that
//! entry frame ends its segment in the interpreter's frame chain. So the native frame whose stack
//! range holds a segment's entry frame is the activation running that segment, and replacing one
//! by the other puts C code under the Python function that called it and Python callbacks under
//! the C function that called them. This needs no symbols, which stripped builds and the
//! tail-calling interpreter of 3.15 (whose opcode handlers are nameless) do not offer.
//!
//! Where the frame bases cannot place any entry frame, interpreter activations are recognised by
//! name (`_PyEval_EvalFrameDefault`) and matched to segments in order.

use crate::stack::{Frame, NativeFrame, PythonFrame};

/// One entry of a thread's Python frame chain, innermost first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PyStackItem {
    Frame(PythonFrame),
    /// An entry frame at this address: the end of the segment run by one interpreter activation.
    SegmentEnd { entry_frame: u64 },
}

/// A sample's user stack.
#[derive(Clone, Debug, Default)]
pub struct NativeStack {
    /// The frames of each stack entry, innermost first (an inlined call gives several).
    pub levels: Vec<Vec<NativeFrame>>,
    /// The frame base of each level, innermost first (its frame-pointer value, or CFA - 16 when
    /// unwound from CFI: where a frame-pointer prologue puts it); may be shorter.
    pub frame_bases: Vec<u64>,
    /// The stack pointer at the sample: the innermost level's frame starts there.
    pub sp: u64,
}

impl NativeStack {
    /// Levels up to the first return address that lies in no mapping: an unwind that ran into
    /// code without frame pointers continues from garbage there.
    fn trusted_levels(&self) -> usize {
        let mapped = |level: &Vec<NativeFrame>| level.iter().any(|f| f.module.is_some());
        if !self.levels.iter().any(mapped) {
            return self.levels.len();
        }
        self.levels.iter().skip(1).position(|level| !mapped(level)).map_or(self.levels.len(), |i| i + 1)
    }

    /// Whether the stack reaches the C library's code that calls `main` or starts a thread: a
    /// frame-pointer walk that got there unwound every frame above (glibc's own start code keeps no
    /// frame pointer, so the walk rarely ends at a zero one).
    pub fn reaches_start_code(&self) -> bool {
        const START_CODE: [&str; 5] = ["__libc_start_call_main", "__libc_start_main", "__libc_start_main_impl", "start_thread", "_start"];
        self.levels[..self.trusted_levels()].iter().flatten().any(|f| f.symbol.as_deref().is_some_and(|name| START_CODE.contains(&name)))
    }

    /// The frames worth showing when there is no Python stack to merge.
    pub fn trusted_frames(&self) -> Vec<Frame> {
        self.levels[..self.trusted_levels()].iter().flatten().cloned().map(Frame::Native).collect()
    }

    /// The level whose stack frame holds `addr`.
    fn level_holding(&self, addr: u64, trusted: usize) -> Option<usize> {
        (0..trusted.min(self.frame_bases.len())).find(|&i| {
            let low = if i == 0 { self.sp } else { self.frame_bases[i - 1] };
            low < addr && addr < self.frame_bases[i]
        })
    }
}

struct Segment<'a> {
    frames: Vec<&'a PythonFrame>,
    entry_frame: Option<u64>,
}

/// Splits the Python chain into the segments of successive interpreter activations, innermost first.
fn python_segments(python: &[PyStackItem]) -> Vec<Segment<'_>> {
    let mut segments = Vec::new();
    let mut frames = Vec::new();
    for item in python {
        match item {
            PyStackItem::Frame(frame) => frames.push(frame),
            PyStackItem::SegmentEnd { entry_frame } => {
                if !frames.is_empty() {
                    segments.push(Segment { frames: std::mem::take(&mut frames), entry_frame: Some(*entry_frame) });
                }
            }
        }
    }
    if !frames.is_empty() {
        segments.push(Segment { frames, entry_frame: None });
    }
    segments
}

/// Symbols of native frames that run Python code.
fn is_interpreter_frame(frame: &NativeFrame) -> bool {
    frame.symbol.as_deref().is_some_and(|name| {
        name == "_PyEval_EvalFrameDefault"
            // The perf trampoline (`-X perf`) names each Python function `py::qualname:file`.
            || name.starts_with("py::")
    })
}

/// For each segment, the native level it replaces, if any.
fn place_segments(native: &NativeStack, segments: &[Segment<'_>], trusted: usize) -> Vec<Option<usize>> {
    let mut placed = Vec::with_capacity(segments.len());
    let mut next_free = 0;
    for segment in segments {
        let level = segment
            .entry_frame
            .and_then(|entry| native.level_holding(entry, trusted))
            .filter(|&level| level >= next_free);
        if let Some(level) = level {
            next_free = level + 1;
        }
        placed.push(level);
    }
    if placed.iter().any(Option::is_some) {
        return placed;
    }
    // No entry frame could be placed (no frame pointers): fall back to names, in order.
    let mut interpreter_levels = (0..trusted)
        .filter(|&i| native.levels[i].iter().any(is_interpreter_frame))
        .filter(|&i| i == 0 || !native.levels[i - 1].iter().any(is_interpreter_frame));
    segments.iter().map(|_| interpreter_levels.next()).collect()
}

/// Merges a native stack and a Python stack, both innermost first.
///
/// A segment that could not be placed goes right before the next placed one, or, after the last,
/// below the native frames that were captured: those are above it, so the order stays right.
pub fn merge_stacks(native: &NativeStack, python: &[PyStackItem]) -> Vec<Frame> {
    let segments = python_segments(python);
    let trusted = native.trusted_levels();
    let placed = place_segments(native, &segments, trusted);
    let emit = |merged: &mut Vec<Frame>, segments: &[Segment<'_>]| {
        for segment in segments {
            merged.extend(segment.frames.iter().map(|f| Frame::Python((*f).clone())));
        }
    };
    let mut merged = Vec::new();
    let mut next = 0;
    for (level, frames) in native.levels[..trusted].iter().enumerate() {
        let next_placed = (next..segments.len()).find(|&k| placed[k].is_some());
        match next_placed {
            Some(k) if placed[k] == Some(level) => {
                emit(&mut merged, &segments[next..=k]);
                next = k + 1;
            }
            _ => merged.extend(frames.iter().cloned().map(Frame::Native)),
        }
    }
    emit(&mut merged, &segments[next..]);
    merged
}

/// The Python frames alone, innermost first (`--no-native`).
pub fn python_only(python: &[PyStackItem]) -> Vec<Frame> {
    python
        .iter()
        .filter_map(|item| match item {
            PyStackItem::Frame(frame) => Some(Frame::Python(frame.clone())),
            PyStackItem::SegmentEnd { .. } => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::stack::Module;

    fn module() -> Option<Arc<Module>> {
        Some(Arc::new(Module { path: "python3".into(), start: 0, limit: 1 << 40, file_offset: 0, build_id: None }))
    }

    fn native(name: &str) -> Vec<NativeFrame> {
        vec![NativeFrame { addr: 0, module: module(), symbol: Some(name.into()), file: None, line: None }]
    }

    fn garbage() -> Vec<NativeFrame> {
        vec![NativeFrame { addr: 0x5a5a_5a5a, module: None, symbol: None, file: None, line: None }]
    }

    fn py(name: &str) -> PyStackItem {
        PyStackItem::Frame(PythonFrame { qualname: name.into(), filename: "t.py".into(), first_line: 1, line: 1 })
    }

    fn end(entry_frame: u64) -> PyStackItem {
        PyStackItem::SegmentEnd { entry_frame }
    }

    /// A stack whose level `i` owns the stack range (1000 + 100 * i, 1100 + 100 * i).
    fn stack(levels: Vec<Vec<NativeFrame>>) -> NativeStack {
        let frame_bases = (0..levels.len() as u64).map(|i| 1100 + 100 * i).collect();
        NativeStack { levels, frame_bases, sp: 1000 }
    }

    fn names(frames: &[Frame]) -> Vec<String> {
        frames
            .iter()
            .map(|f| match f {
                Frame::Native(n) => n.symbol.as_deref().unwrap_or("?").to_string(),
                Frame::Python(p) => format!("py:{}", p.qualname),
                Frame::Kernel(k) => format!("{}_[k]", k.symbol.as_deref().unwrap_or("?")),
            })
            .collect()
    }

    #[test]
    fn c_called_from_python_sits_under_its_caller() {
        // The entry frame lies in level 2's stack range, whatever that function is called.
        let n = stack(vec![native("sha256_block"), native("_sha256_update"), native("python3+0x2333c8"), native("PyEval_EvalCode"), native("main")]);
        let p = [py("hash_caller"), py("<module>"), end(1250)];
        assert_eq!(
            names(&merge_stacks(&n, &p)),
            ["sha256_block", "_sha256_update", "py:hash_caller", "py:<module>", "PyEval_EvalCode", "main"]
        );
    }

    #[test]
    fn python_called_back_from_c_sits_under_that_c_frame() {
        let n = stack(vec![native("handler"), native("eval"), native("sorted_with_key"), native("eval"), native("main")]);
        let p = [py("key"), end(1150), py("sorter"), py("<module>"), end(1350)];
        assert_eq!(
            names(&merge_stacks(&n, &p)),
            ["handler", "py:key", "sorted_with_key", "py:sorter", "py:<module>", "main"]
        );
    }

    #[test]
    fn without_frame_bases_interpreter_frames_are_found_by_name() {
        let n = NativeStack { levels: vec![native("_PyEval_EvalFrameDefault"), native("cfunc"), native("_PyEval_EvalFrameDefault"), native("main")], ..Default::default() };
        let p = [py("inner"), end(1), py("outer"), end(2)];
        assert_eq!(names(&merge_stacks(&n, &p)), ["py:inner", "cfunc", "py:outer", "main"]);
    }

    #[test]
    fn an_unwind_into_garbage_stops_there_and_python_follows() {
        let n = NativeStack { levels: vec![native("PyLong_Add"), garbage(), native("libc+0x29fb9")], ..Default::default() };
        let p = [py("inner"), end(1), py("outer"), end(2)];
        assert_eq!(names(&merge_stacks(&n, &p)), ["PyLong_Add", "py:inner", "py:outer"]);
    }

    #[test]
    fn a_segment_that_cannot_be_placed_goes_before_the_next_placed_one() {
        let n = stack(vec![native("leaf"), native("eval"), native("main")]);
        let p = [py("inner"), end(99_999), py("outer"), end(1150)];
        assert_eq!(names(&merge_stacks(&n, &p)), ["leaf", "py:inner", "py:outer", "main"]);
    }

    #[test]
    fn interpreter_frame_without_a_segment_stays_native() {
        let n = stack(vec![native("_PyEval_EvalFrameDefault"), native("main")]);
        assert_eq!(names(&merge_stacks(&n, &[])), ["_PyEval_EvalFrameDefault", "main"]);
    }

    #[test]
    fn start_code_is_recognised_only_among_trusted_levels() {
        assert!(stack(vec![native("leaf"), native("main"), native("__libc_start_call_main")]).reaches_start_code());
        assert!(!stack(vec![native("leaf"), native("main")]).reaches_start_code());
        let past_garbage = NativeStack { levels: vec![native("leaf"), garbage(), native("__libc_start_call_main")], ..Default::default() };
        assert!(!past_garbage.reaches_start_code());
    }

    #[test]
    fn python_only_drops_native_frames_and_markers() {
        let p = [py("a"), end(1), py("b")];
        assert_eq!(names(&python_only(&p)), ["py:a", "py:b"]);
    }
}
