//! Merging a sample's native stack with its Python stack.
//!
//! Since CPython 3.11 a Python-to-Python call does not recurse in C: one `_PyEval_EvalFrameDefault`
//! activation runs a whole *segment* of Python frames, and a new activation starts only when C code
//! calls back into Python. Each activation pushes an entry frame that ends its segment in the
//! interpreter's frame chain. So the n-th interpreter frame of the native stack (innermost first)
//! stands for the n-th segment of the Python stack, and replacing one by the other puts C code under
//! the Python function that called it and Python callbacks under the C function that called them.

use crate::stack::{Frame, NativeFrame, PythonFrame};

/// One entry of a thread's Python frame chain, innermost first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PyStackItem {
    Frame(PythonFrame),
    /// An entry frame: the end of the segment run by one interpreter activation.
    SegmentEnd,
}

/// Symbols of native frames that run Python code.
fn is_interpreter_frame(frame: &NativeFrame) -> bool {
    frame.symbol.as_deref().is_some_and(|name| {
        name == "_PyEval_EvalFrameDefault"
            // The perf trampoline (`-X perf`) names each Python function `py::qualname:file`.
            || name.starts_with("py::")
    })
}

/// Splits the Python chain into the segments of successive interpreter activations, innermost first.
fn python_segments(python: &[PyStackItem]) -> Vec<Vec<&PythonFrame>> {
    let mut segments = Vec::new();
    let mut current = Vec::new();
    for item in python {
        match item {
            PyStackItem::Frame(frame) => current.push(frame),
            PyStackItem::SegmentEnd => {
                if !current.is_empty() {
                    segments.push(std::mem::take(&mut current));
                }
            }
        }
    }
    if !current.is_empty() {
        segments.push(current);
    }
    segments
}

/// Merges a native stack and a Python stack, both innermost first.
///
/// Each run of interpreter frames in the native stack is replaced by the next Python segment. Where
/// the native unwind stopped before reaching every activation (interpreters built without frame
/// pointers), the Python segments left over follow the native frames that were captured, rootward:
/// the captured frames are above all of them, so the order stays right. An interpreter frame with no
/// segment left (a thread between frames) is kept as a native frame.
pub fn merge_stacks(native: &[NativeFrame], python: &[PyStackItem]) -> Vec<Frame> {
    let mut segments = python_segments(python).into_iter();
    let mut merged = Vec::with_capacity(native.len() + python.len());
    let mut in_interpreter_run = false;
    for frame in native {
        if is_interpreter_frame(frame) {
            if in_interpreter_run {
                continue;
            }
            in_interpreter_run = true;
            match segments.next() {
                Some(segment) => merged.extend(segment.into_iter().cloned().map(Frame::Python)),
                None => merged.push(Frame::Native(frame.clone())),
            }
        } else {
            in_interpreter_run = false;
            merged.push(Frame::Native(frame.clone()));
        }
    }
    for segment in segments {
        merged.extend(segment.into_iter().cloned().map(Frame::Python));
    }
    merged
}

/// The Python frames alone, innermost first (`--no-native`).
pub fn python_only(python: &[PyStackItem]) -> Vec<Frame> {
    python
        .iter()
        .filter_map(|item| match item {
            PyStackItem::Frame(frame) => Some(Frame::Python(frame.clone())),
            PyStackItem::SegmentEnd => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn native(name: &str) -> NativeFrame {
        NativeFrame { addr: 0, module: None, symbol: Some(name.into()), file: None, line: None }
    }

    fn py(name: &str) -> PyStackItem {
        PyStackItem::Frame(PythonFrame {
            qualname: name.into(),
            filename: "t.py".into(),
            first_line: 1,
            line: 1,
        })
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

    const EVAL: &str = "_PyEval_EvalFrameDefault";

    #[test]
    fn c_called_from_python_sits_under_its_caller() {
        let n = [native("sha256_block"), native("_sha256_update"), native(EVAL), native("PyEval_EvalCode"), native("main")];
        let p = [py("hash_caller"), py("<module>"), PyStackItem::SegmentEnd];
        assert_eq!(
            names(&merge_stacks(&n, &p)),
            ["sha256_block", "_sha256_update", "py:hash_caller", "py:<module>", "PyEval_EvalCode", "main"]
        );
    }

    #[test]
    fn python_called_back_from_c_sits_under_that_c_frame() {
        let n = [native(EVAL), native("sorted_with_key"), native(EVAL), native("main")];
        let p = [py("key"), PyStackItem::SegmentEnd, py("sorter"), py("<module>"), PyStackItem::SegmentEnd];
        assert_eq!(
            names(&merge_stacks(&n, &p)),
            ["py:key", "sorted_with_key", "py:sorter", "py:<module>", "main"]
        );
    }

    #[test]
    fn truncated_native_unwind_keeps_the_python_stack_below_what_was_captured() {
        let n = [native("PyLong_Add")];
        let p = [py("inner"), PyStackItem::SegmentEnd, py("outer"), PyStackItem::SegmentEnd];
        assert_eq!(names(&merge_stacks(&n, &p)), ["PyLong_Add", "py:inner", "py:outer"]);
    }

    #[test]
    fn interpreter_frame_without_a_segment_stays_native() {
        let n = [native(EVAL), native("main")];
        assert_eq!(names(&merge_stacks(&n, &[])), [EVAL, "main"]);
    }

    #[test]
    fn python_only_drops_native_frames_and_markers() {
        let p = [py("a"), PyStackItem::SegmentEnd, py("b")];
        assert_eq!(names(&python_only(&p)), ["py:a", "py:b"]);
    }
}
