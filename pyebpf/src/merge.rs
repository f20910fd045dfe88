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
//! name (`_PyEval_EvalFrameDefault`) and matched to segments in order. That is always so on 3.11,
//! whose entry frames are flagged Python frames on the interpreter's own stack, not the C stack.

use crate::stack::NativeFrame;

/// One entry of a thread's Python frame chain, innermost first; `F` is the resolved frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PyStackItem<F> {
    Frame(F),
    /// An entry frame at this address: the end of the segment run by one interpreter activation.
    /// 0 where the entry frame is not on the C stack (3.11): the segment is then placed by name.
    SegmentEnd {
        entry_frame: u64,
    },
}

/// What the merge needs to know of one user stack entry (its frames: one, or several inlined).
pub trait NativeLevel {
    /// The address lies in a mapping of the process.
    fn is_mapped(&self) -> bool;
    /// One of its frames runs Python code (by symbol name).
    fn runs_python(&self) -> bool;
    /// One of its frames is the C library's code that calls `main` or starts a thread.
    fn is_start_code(&self) -> bool;
    /// It lies in the C library.
    fn in_libc(&self) -> bool;
}

/// A sample's user stack.
#[derive(Clone, Copy, Debug)]
pub struct NativeStack<'a, L> {
    /// Each stack entry, innermost first.
    pub levels: &'a [L],
    /// The frame base (frame-pointer value) of each level, innermost first; may be shorter.
    pub frame_bases: &'a [u64],
    /// The stack pointer at the sample: the innermost level's frame starts there.
    pub sp: u64,
}

impl<L: NativeLevel> NativeStack<'_, L> {
    /// Levels up to the first return address that lies in no mapping: an unwind that ran into
    /// code without frame pointers continues from garbage there.
    pub fn trusted_levels(&self) -> usize {
        if !self.levels.iter().any(L::is_mapped) {
            return self.levels.len();
        }
        self.levels.iter().skip(1).position(|level| !level.is_mapped()).map_or(self.levels.len(), |i| i + 1)
    }

    /// Whether the stack reaches the C library's start code: a frame-pointer walk that got there
    /// unwound every frame above (glibc's own start code keeps no frame pointer, so the walk
    /// rarely ends at a zero one). Where the C library's local symbols are stripped, its start
    /// code is known as the outermost level lying in the C library.
    pub fn reaches_start_code(&self) -> bool {
        let trusted = &self.levels[..self.trusted_levels()];
        trusted.iter().any(L::is_start_code) || (trusted.len() > 1 && trusted.last().is_some_and(L::in_libc))
    }

    /// Whether only the C library's code lies past level `end` of a stack unwound to its root,
    /// but for the outermost level (the program's entry point): the start code that calls `main`
    /// or a thread's function.
    pub fn only_start_code_past(&self, end: usize) -> bool {
        let outer = self.levels.get(end + 1..self.levels.len().saturating_sub(1)).unwrap_or_default();
        outer.iter().all(|level| level.in_libc() || level.is_start_code())
    }

    /// The level whose stack frame holds `addr`.
    fn level_holding(&self, addr: u64, trusted: usize) -> Option<usize> {
        (0..trusted.min(self.frame_bases.len())).find(|&i| {
            let low = if i == 0 { self.sp } else { self.frame_bases[i - 1] };
            low < addr && addr < self.frame_bases[i]
        })
    }
}

/// A piece of a merged stack, innermost first: a native level or a Python frame.
#[derive(Debug)]
pub enum Merged<'a, L, F> {
    Native(&'a L),
    Python(&'a F),
}

/// The Python frames `python[start..end]` run by one interpreter activation.
#[derive(Clone, Copy, Debug)]
struct Segment {
    start: usize,
    end: usize,
    entry_frame: Option<u64>,
}

/// Merges stacks with buffers reused from sample to sample.
#[derive(Debug, Default)]
pub struct Merger {
    segments: Vec<Segment>,
    placed: Vec<Option<usize>>,
    /// Where the segments past the last placed one go when the native stack reached the start
    /// code and no level left runs Python by name: right before this level, as its callees.
    rest_before: Option<usize>,
}

impl Merger {
    /// Merges a native stack and a Python stack, both innermost first, into `emit`.
    ///
    /// A segment that could not be placed goes right before the next placed one. After the last,
    /// it goes below the native frames that were captured where the unwind stopped early (those
    /// are above it); where the unwind reached the start code, its activation is among the native
    /// frames left ([`Self::place_rest`]).
    pub fn merge<'a, L: NativeLevel, F>(&mut self, native: &NativeStack<'a, L>, python: &'a [PyStackItem<F>], mut emit: impl FnMut(Merged<'a, L, F>)) {
        self.split_segments(python);
        let trusted = native.trusted_levels();
        self.place_segments(native, trusted);
        self.place_rest(native, trusted);
        let segments = &self.segments;
        let placed = &self.placed;
        let rest_before = self.rest_before;
        let emit_segments = |emit: &mut dyn FnMut(Merged<'a, L, F>), segments: &[Segment]| {
            for segment in segments {
                for item in &python[segment.start..segment.end] {
                    if let PyStackItem::Frame(frame) = item {
                        emit(Merged::Python(frame));
                    }
                }
            }
        };
        let mut next = 0;
        for (level, frames) in native.levels[..trusted].iter().enumerate() {
            let next_placed = (next..segments.len()).find(|&k| placed[k].is_some());
            match next_placed {
                Some(k) if placed[k] == Some(level) => {
                    emit_segments(&mut emit, &segments[next..=k]);
                    next = k + 1;
                }
                None if rest_before == Some(level) => {
                    emit_segments(&mut emit, &segments[next..]);
                    next = segments.len();
                    emit(Merged::Native(frames));
                }
                _ => emit(Merged::Native(frames)),
            }
        }
        emit_segments(&mut emit, &segments[next..]);
    }

    /// The segments after the last placed one, where the native stack reached the start code
    /// (a Python chain cut before its outermost segment's end, or an activation not found by
    /// name): their activation lies past the last placed level. The first level past it that runs
    /// Python by name is it; without names they go right past the last placed level, as callees of
    /// every native level left: never callers of the start code (C code the segment's innermost
    /// frame called, if any, then shows as its caller).
    fn place_rest<L: NativeLevel>(&mut self, native: &NativeStack<'_, L>, trusted: usize) {
        self.rest_before = None;
        if self.placed.last() != Some(&None) || !native.reaches_start_code() {
            return;
        }
        let from = self.placed.iter().rev().find_map(|&placed| placed).map_or(0, |level| level + 1);
        match (from..trusted).find(|&level| native.levels[level].runs_python()) {
            Some(level) => *self.placed.last_mut().expect("checked above") = Some(level),
            None => self.rest_before = Some(from),
        }
    }

    /// Splits the Python chain into the segments of successive interpreter activations, innermost first.
    fn split_segments<F>(&mut self, python: &[PyStackItem<F>]) {
        self.segments.clear();
        let mut start = 0;
        for (i, item) in python.iter().enumerate() {
            if let PyStackItem::SegmentEnd { entry_frame } = item {
                if python[start..i].iter().any(|item| matches!(item, PyStackItem::Frame(_))) {
                    self.segments.push(Segment { start, end: i, entry_frame: Some(*entry_frame) });
                }
                start = i + 1;
            }
        }
        if python[start..].iter().any(|item| matches!(item, PyStackItem::Frame(_))) {
            self.segments.push(Segment { start, end: python.len(), entry_frame: None });
        }
    }

    /// For each segment, the native level it replaces, if any.
    fn place_segments<L: NativeLevel>(&mut self, native: &NativeStack<'_, L>, trusted: usize) {
        self.placed.clear();
        let mut next_free = 0;
        for segment in &self.segments {
            let level = segment.entry_frame.and_then(|entry| native.level_holding(entry, trusted)).filter(|&level| level >= next_free);
            if let Some(level) = level {
                next_free = level + 1;
            }
            self.placed.push(level);
        }
        if self.placed.iter().any(Option::is_some) {
            return;
        }
        // No entry frame could be placed (no frame pointers): fall back to names, in order.
        let levels = native.levels;
        let mut interpreter_levels = (0..trusted).filter(|&i| levels[i].runs_python()).filter(|&i| i == 0 || !levels[i - 1].runs_python());
        for placed in &mut self.placed {
            *placed = interpreter_levels.next();
        }
    }
}

/// Symbols of native frames that run Python code.
pub fn is_interpreter_frame(frame: &NativeFrame) -> bool {
    frame.symbol.as_deref().is_some_and(|name| {
        name == "_PyEval_EvalFrameDefault"
            // The perf trampoline (`-X perf`) names each Python function `py::qualname:file`.
            || name.starts_with("py::")
    })
}

/// Symbols of the C library's code that calls `main` or starts a thread.
pub fn is_start_code(frame: &NativeFrame) -> bool {
    const START_CODE: [&str; 5] = ["__libc_start_call_main", "__libc_start_main", "__libc_start_main_impl", "start_thread", "_start"];
    frame.symbol.as_deref().is_some_and(|name| START_CODE.contains(&name))
}

/// A frame of the C library (glibc's `libc.so.6`, or musl's `libc.so`).
pub fn in_libc(frame: &NativeFrame) -> bool {
    frame.module.as_ref().is_some_and(|module| {
        std::path::Path::new(&*module.path)
            .file_name()
            .and_then(|name| name.to_str())
            .is_some_and(|name| name.starts_with("libc.so") || name.starts_with("libc-"))
    })
}

/// The Python frames alone, innermost first (`--no-native`).
pub fn python_frames<F>(python: &[PyStackItem<F>]) -> impl Iterator<Item = &F> {
    python.iter().filter_map(|item| match item {
        PyStackItem::Frame(frame) => Some(frame),
        PyStackItem::SegmentEnd { .. } => None,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::stack::{Frame, Module, PythonFrame};

    type Item = PyStackItem<PythonFrame>;

    /// The merged stack as frames.
    fn merge_stacks(native: &Owned, python: &[Item]) -> Vec<Frame> {
        let stack = NativeStack { levels: &native.levels, frame_bases: &native.frame_bases, sp: native.sp };
        let mut merged = Vec::new();
        Merger::default().merge(&stack, python, |piece| match piece {
            Merged::Native(level) => merged.extend(level.iter().cloned().map(Frame::Native)),
            Merged::Python(frame) => merged.push(Frame::Python(frame.clone())),
        });
        merged
    }

    fn python_only(python: &[Item]) -> Vec<Frame> {
        python_frames(python).cloned().map(Frame::Python).collect()
    }

    impl NativeLevel for Vec<NativeFrame> {
        fn is_mapped(&self) -> bool {
            self.iter().any(|f| f.module.is_some())
        }

        fn runs_python(&self) -> bool {
            self.iter().any(is_interpreter_frame)
        }

        fn is_start_code(&self) -> bool {
            self.iter().any(is_start_code)
        }

        fn in_libc(&self) -> bool {
            self.iter().any(in_libc)
        }
    }

    #[derive(Default)]
    struct Owned {
        levels: Vec<Vec<NativeFrame>>,
        frame_bases: Vec<u64>,
        sp: u64,
    }

    fn module() -> Option<Arc<Module>> {
        Some(Arc::new(Module { path: "python3".into(), start: 0, limit: 1 << 40, file_offset: 0, build_id: None }))
    }

    fn native(name: &str) -> Vec<NativeFrame> {
        vec![NativeFrame { addr: 0, module: module(), symbol: Some(name.into()), file: None, line: None }]
    }

    fn garbage() -> Vec<NativeFrame> {
        vec![NativeFrame { addr: 0x5a5a_5a5a, module: None, symbol: None, file: None, line: None }]
    }

    fn py(name: &str) -> Item {
        PyStackItem::Frame(PythonFrame { qualname: name.into(), filename: "t.py".into(), first_line: 1, line: 1 })
    }

    fn end(entry_frame: u64) -> Item {
        PyStackItem::SegmentEnd { entry_frame }
    }

    /// A stack whose level `i` owns the stack range (1000 + 100 * i, 1100 + 100 * i).
    fn stack(levels: Vec<Vec<NativeFrame>>) -> Owned {
        let frame_bases = (0..levels.len() as u64).map(|i| 1100 + 100 * i).collect();
        Owned { levels, frame_bases, sp: 1000 }
    }

    fn names(frames: &[Frame]) -> Vec<String> {
        frames
            .iter()
            .map(|f| match f {
                Frame::Native(n) => n.symbol.as_deref().unwrap_or("?").to_string(),
                Frame::Python(p) => format!("py:{}", p.qualname),
                Frame::Kernel(k) => format!("{}_[k]", k.symbol.as_deref().unwrap_or("?")),
                Frame::Task(name) => format!("task:{name}"),
            })
            .collect()
    }

    #[test]
    fn c_called_from_python_sits_under_its_caller() {
        // The entry frame lies in level 2's stack range, whatever that function is called.
        let n = stack(vec![native("sha256_block"), native("_sha256_update"), native("python3+0x2333c8"), native("PyEval_EvalCode"), native("main")]);
        let p = [py("hash_caller"), py("<module>"), end(1250)];
        assert_eq!(names(&merge_stacks(&n, &p)), ["sha256_block", "_sha256_update", "py:hash_caller", "py:<module>", "PyEval_EvalCode", "main"]);
    }

    #[test]
    fn python_called_back_from_c_sits_under_that_c_frame() {
        let n = stack(vec![native("handler"), native("eval"), native("sorted_with_key"), native("eval"), native("main")]);
        let p = [py("key"), end(1150), py("sorter"), py("<module>"), end(1350)];
        assert_eq!(names(&merge_stacks(&n, &p)), ["handler", "py:key", "sorted_with_key", "py:sorter", "py:<module>", "main"]);
    }

    #[test]
    fn without_frame_bases_interpreter_frames_are_found_by_name() {
        let n = Owned {
            levels: vec![native("_PyEval_EvalFrameDefault"), native("cfunc"), native("_PyEval_EvalFrameDefault"), native("main")],
            ..Default::default()
        };
        let p = [py("inner"), end(1), py("outer"), end(2)];
        assert_eq!(names(&merge_stacks(&n, &p)), ["py:inner", "cfunc", "py:outer", "main"]);
    }

    /// 3.11: entry frames are not on the C stack (address 0), even where frame bases are known.
    #[test]
    fn entry_frames_off_the_c_stack_are_placed_by_name() {
        let n = stack(vec![
            native("sha256_block"),
            native("_PyEval_EvalFrameDefault"),
            native("sorted_with_key"),
            native("_PyEval_EvalFrameDefault"),
            native("main"),
        ]);
        let p = [py("hash_caller"), end(0), py("key"), py("sorter"), end(0)];
        assert_eq!(names(&merge_stacks(&n, &p)), ["sha256_block", "py:hash_caller", "sorted_with_key", "py:key", "py:sorter", "main"]);
    }

    #[test]
    fn an_unwind_into_garbage_stops_there_and_python_follows() {
        let n = Owned { levels: vec![native("PyLong_Add"), garbage(), native("libc+0x29fb9")], ..Default::default() };
        let p = [py("inner"), end(1), py("outer"), end(2)];
        assert_eq!(names(&merge_stacks(&n, &p)), ["PyLong_Add", "py:inner", "py:outer"]);
    }

    #[test]
    fn a_segment_that_cannot_be_placed_goes_before_the_next_placed_one() {
        let n = stack(vec![native("leaf"), native("eval"), native("main")]);
        let p = [py("inner"), end(99_999), py("outer"), end(1150)];
        assert_eq!(names(&merge_stacks(&n, &p)), ["leaf", "py:inner", "py:outer", "main"]);
    }

    /// A chain cut before its outermost segment's end (deeper than the kernel walks): the cut
    /// segment runs in an activation past the last placed level, never above the start code.
    #[test]
    fn a_cut_segment_goes_below_the_start_code() {
        let p = [py("leaf"), end(1150), py("deep"), py("deeper")];
        let n = stack(vec![native("cfunc"), native("eval"), native("_PyEval_EvalFrameDefault"), native("PyEval_EvalCode"), native("main"), native("_start")]);
        assert_eq!(names(&merge_stacks(&n, &p)), ["cfunc", "py:leaf", "py:deep", "py:deeper", "PyEval_EvalCode", "main", "_start"]);
        // Its activation without a name (3.15's nameless opcode handlers): right past the last
        // placed level.
        let n = stack(vec![native("cfunc"), native("handler"), native("handler"), native("PyEval_EvalCode"), native("main"), native("_start")]);
        assert_eq!(names(&merge_stacks(&n, &p)), ["cfunc", "py:leaf", "py:deep", "py:deeper", "handler", "PyEval_EvalCode", "main", "_start"]);
        let n = stack(vec![native("handler"), native("PyEval_EvalCode"), native("main"), native("_start")]);
        assert_eq!(names(&merge_stacks(&n, &[py("deep"), py("deeper")])), ["py:deep", "py:deeper", "handler", "PyEval_EvalCode", "main", "_start"]);
        // An unwind that stopped early captured only frames above it.
        let n = stack(vec![native("cfunc"), native("handler")]);
        assert_eq!(names(&merge_stacks(&n, &[py("deep"), py("deeper")])), ["cfunc", "handler", "py:deep", "py:deeper"]);
    }

    #[test]
    fn interpreter_frame_without_a_segment_stays_native() {
        let n = stack(vec![native("_PyEval_EvalFrameDefault"), native("main")]);
        assert_eq!(names(&merge_stacks(&n, &[])), ["_PyEval_EvalFrameDefault", "main"]);
    }

    #[test]
    fn start_code_is_reached_by_name_or_as_an_outermost_libc_level() {
        let reaches = |levels: Vec<Vec<NativeFrame>>| {
            let owned = stack(levels);
            NativeStack { levels: &owned.levels, frame_bases: &owned.frame_bases, sp: owned.sp }.reaches_start_code()
        };
        let libc = |symbol: Option<&str>| {
            let module = Arc::new(Module { path: "/usr/lib/x86_64-linux-gnu/libc.so.6".into(), start: 0, limit: 1 << 40, file_offset: 0, build_id: None });
            vec![NativeFrame { addr: 0x29fb9, module: Some(module), symbol: symbol.map(Into::into), file: None, line: None }]
        };
        assert!(reaches(vec![native("f"), native("_start")]));
        assert!(reaches(vec![native("f"), native("Py_BytesMain"), libc(None)]));
        assert!(!reaches(vec![libc(Some("memcpy")), native("f")]), "a libc leaf is not the start code");
        assert!(!reaches(vec![native("f"), native("g")]));
        assert!(!reaches(vec![native("f"), garbage(), libc(None)]), "libc after garbage is not trusted");
    }

    #[test]
    fn python_only_drops_native_frames_and_markers() {
        let p = [py("a"), end(1), py("b")];
        assert_eq!(names(&python_only(&p)), ["py:a", "py:b"]);
    }
}
