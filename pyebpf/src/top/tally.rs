//! What `top` shows, computed from the stacks of one refresh window: for every function of every
//! process, its own samples (the sample's innermost frame) and total samples (anywhere on the
//! stack, once per sample), plus the samples accumulated over all windows so far.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use crate::stack::{Frame, Profile, Stack};

/// A function is dropped from the accumulated times after this many windows without a sample,
/// so a long-running top over churning processes keeps a bounded table.
const FORGET_AFTER_WINDOWS: u64 = 600;

/// Which frames of a stack count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameView {
    /// Native, kernel and Python frames as `record` merges them.
    Merged,
    /// Python frames only; samples without any count in the window but give no rows.
    PythonOnly,
}

impl FrameView {
    pub fn toggled(self) -> FrameView {
        match self {
            FrameView::Merged => FrameView::PythonOnly,
            FrameView::PythonOnly => FrameView::Merged,
        }
    }

    fn index(self) -> usize {
        match self {
            FrameView::Merged => 0,
            FrameView::PythonOnly => 1,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SortBy {
    Own,
    Total,
}

/// One row's identity: a function of one process.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Function {
    pub pid: u32,
    pub comm: Arc<str>,
    pub name: Arc<str>,
    /// `file:line` (where the function starts) for Python, the module's file name for native
    /// code, `[kernel]` for the kernel; empty when unknown.
    pub location: Arc<str>,
    pub python: bool,
}

impl Function {
    fn of(stack: &Stack<'_>, frame: &Frame) -> Function {
        let unknown = || Arc::<str>::from("[unknown]");
        let (name, location, python) = match frame {
            Frame::Python(python) => (python.qualname.clone(), format!("{}:{}", python.filename, python.first_line).into(), true),
            Frame::Native(native) => {
                let module = native
                    .module
                    .as_ref()
                    .map(|module| Path::new(&*module.path).file_name().map_or(module.path.to_string(), |name| name.to_string_lossy().into_owned()));
                (native.symbol.clone().unwrap_or_else(unknown), module.unwrap_or_default().into(), false)
            }
            Frame::Kernel(kernel) => (kernel.symbol.clone().unwrap_or_else(unknown), "[kernel]".into(), false),
            Frame::Task(name) => (crate::output::task_name(name).into(), "[asyncio]".into(), true),
        };
        Function { pid: stack.pid, comm: stack.comm.into(), name, location, python }
    }
}

/// A function's time in nanoseconds (samples on CPU, intervals off it) in the window just ended,
/// and since top started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    pub function: Function,
    pub own: u64,
    pub total: u64,
    pub own_so_far: u64,
    pub total_so_far: u64,
}

/// What one window gave, in both frame views, so switching views needs no new window.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Every sample the window kept, with or without rows, and the nanoseconds they stand for.
    pub samples: u64,
    pub ns: u64,
    /// Indexed by [`FrameView::index`].
    rows: [Vec<Row>; 2],
}

impl Snapshot {
    pub fn rows(&self, view: FrameView) -> &[Row] {
        &self.rows[view.index()]
    }

    pub fn sort(&mut self, by: SortBy) {
        for rows in &mut self.rows {
            sort_rows(rows, by);
        }
    }
}

/// Most first; ties by the other count, then by name and process so the order is stable.
pub fn sort_rows(rows: &mut [Row], by: SortBy) {
    let key = |row: &Row| match by {
        SortBy::Own => (row.own, row.total, row.own_so_far),
        SortBy::Total => (row.total, row.own, row.total_so_far),
    };
    rows.sort_by(|a, b| key(b).cmp(&key(a)).then_with(|| (&a.function.name, a.function.pid).cmp(&(&b.function.name, b.function.pid))));
}

#[derive(Default)]
struct SoFar {
    own: u64,
    total: u64,
    last_window: u64,
}

/// Collects the stacks of the current window and turns them into rows when it ends.
#[derive(Default)]
pub struct Tally {
    window: Profile,
    so_far: [HashMap<Function, SoFar>; 2],
    windows: u64,
}

impl Tally {
    /// Where the resolver adds the current window's samples.
    pub fn window_mut(&mut self) -> &mut Profile {
        &mut self.window
    }

    /// Ends the window: its rows in both views (unsorted), with the accumulated counts updated.
    pub fn end_window(&mut self) -> Snapshot {
        self.windows += 1;
        let next = self.window.next_period();
        let mut window = std::mem::replace(&mut self.window, next);
        let mut snapshot = Snapshot { samples: window.total_samples(), ns: window.total_ns(), rows: Default::default() };
        for view in [FrameView::Merged, FrameView::PythonOnly] {
            let counts = window_counts(&window, view);
            let so_far = &mut self.so_far[view.index()];
            let rows = &mut snapshot.rows[view.index()];
            for (function, (own, total)) in counts {
                let entry = so_far.entry(function.clone()).or_default();
                entry.own += own;
                entry.total += total;
                entry.last_window = self.windows;
                rows.push(Row { function, own, total, own_so_far: entry.own, total_so_far: entry.total });
            }
            let windows = self.windows;
            so_far.retain(|_, entry| windows - entry.last_window < FORGET_AFTER_WINDOWS);
        }
        // The next window goes on with the frame table: the resolver holds ids into it.
        self.window.frames = std::mem::take(&mut window.frames);
        snapshot
    }

    /// Windows ended so far.
    pub fn windows(&self) -> u64 {
        self.windows
    }
}

/// Own and total nanoseconds per function of one window, in one view.
fn window_counts(window: &Profile, view: FrameView) -> HashMap<Function, (u64, u64)> {
    let mut counts: HashMap<Function, (u64, u64)> = HashMap::new();
    let mut seen = HashSet::new();
    for (stack, weight) in window.stacks() {
        let count = weight.ns;
        seen.clear();
        let frames = stack.frames.iter().filter(|frame| view == FrameView::Merged || matches!(frame, Frame::Python(_) | Frame::Task(_)));
        for (depth, frame) in frames.enumerate() {
            let function = Function::of(&stack, frame);
            if depth == 0 {
                counts.entry(function.clone()).or_default().0 += count;
            }
            if !seen.contains(&function) {
                counts.entry(function.clone()).or_default().1 += count;
                seen.insert(function);
            }
        }
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::test_profile::{kernel, key, module, python};

    fn native(symbol: &str) -> Frame {
        crate::output::test_profile::native(&module("/usr/bin/python3.14", 0x1000), 0x1100, Some(symbol))
    }

    fn add(tally: &mut Tally, frames: Vec<Frame>, times: u64) {
        for _ in 0..times {
            tally.window_mut().add(key(10, 11, "python3.14", frames.clone()), 1);
        }
    }

    /// The row of `name`, its times in samples (a test window's sample stands for a second).
    fn find(rows: &[Row], name: &str) -> Row {
        let row = rows.iter().find(|row| &*row.function.name == name).unwrap_or_else(|| panic!("no row {name}: {rows:?}"));
        let samples = |ns: u64| ns / 1_000_000_000;
        Row { own: samples(row.own), total: samples(row.total), own_so_far: samples(row.own_so_far), total_so_far: samples(row.total_so_far), ..row.clone() }
    }

    /// 6 samples in `leaf` (under a native eval frame, called by `main`, recursion counted once),
    /// 3 in `main` itself, 1 native-only sample in the kernel.
    fn window() -> Tally {
        let mut tally = Tally::default();
        let eval = native("_PyEval_EvalFrameDefault");
        add(&mut tally, vec![eval.clone(), python("leaf", "/w.py", 3, 4), eval.clone(), python("main", "/w.py", 8, 9), python("main", "/w.py", 8, 12)], 6);
        add(&mut tally, vec![python("main", "/w.py", 8, 9), eval.clone()], 3);
        add(&mut tally, vec![kernel("do_syscall_64"), native("write")], 1);
        tally
    }

    #[test]
    fn own_is_the_innermost_counted_frame_and_total_counts_a_function_once_per_sample() {
        let snapshot = window().end_window();
        assert_eq!(snapshot.samples, 10);
        let python = snapshot.rows(FrameView::PythonOnly);
        assert_eq!((find(python, "leaf").own, find(python, "leaf").total), (6, 6));
        assert_eq!((find(python, "main").own, find(python, "main").total), (3, 9));
        assert_eq!(python.len(), 2, "Python-only has no native rows: {python:?}");
        assert_eq!(&*find(python, "leaf").function.location, "/w.py:3");

        let merged = snapshot.rows(FrameView::Merged);
        let eval = find(merged, "_PyEval_EvalFrameDefault");
        assert_eq!((eval.own, eval.total), (6, 9));
        assert_eq!(&*eval.function.location, "python3.14");
        assert_eq!((find(merged, "leaf").own, find(merged, "leaf").total), (0, 6));
        assert_eq!((find(merged, "main").own, find(merged, "main").total), (3, 9));
        assert_eq!((find(merged, "do_syscall_64").own, find(merged, "write").total), (1, 1));
        assert_eq!(&*find(merged, "do_syscall_64").function.location, "[kernel]");
    }

    #[test]
    fn accumulated_counts_add_up_over_windows_and_idle_functions_are_forgotten() {
        let mut tally = window();
        tally.end_window();
        add(&mut tally, vec![python("leaf", "/w.py", 3, 5)], 2);
        let snapshot = tally.end_window();
        let leaf = find(snapshot.rows(FrameView::PythonOnly), "leaf");
        assert_eq!((leaf.own, leaf.total, leaf.own_so_far, leaf.total_so_far), (2, 2, 8, 8));
        assert!(snapshot.rows(FrameView::PythonOnly).iter().all(|row| &*row.function.name != "main"), "rows are the window's");
        for _ in 0..FORGET_AFTER_WINDOWS {
            tally.end_window();
        }
        add(&mut tally, vec![python("main", "/w.py", 8, 9)], 1);
        let main = find(tally.end_window().rows(FrameView::PythonOnly), "main");
        assert_eq!((main.own_so_far, main.total_so_far), (1, 1), "main was forgotten after idling");
    }

    #[test]
    fn rows_sort_by_own_or_total_with_stable_ties() {
        let mut snapshot = window().end_window();
        snapshot.sort(SortBy::Own);
        let names = |snapshot: &Snapshot| snapshot.rows(FrameView::PythonOnly).iter().map(|row| row.function.name.to_string()).collect::<Vec<_>>();
        assert_eq!(names(&snapshot), ["leaf", "main"]);
        snapshot.sort(SortBy::Total);
        assert_eq!(names(&snapshot), ["main", "leaf"]);
        let merged: Vec<_> = snapshot.rows(FrameView::Merged).iter().map(|row| (row.function.name.to_string(), row.total / 1_000_000_000)).collect();
        assert_eq!(&merged[..2], [("_PyEval_EvalFrameDefault".to_string(), 9), ("main".to_string(), 9)]);
    }

    #[test]
    fn processes_are_kept_apart() {
        let mut tally = Tally::default();
        tally.window_mut().add(key(1, 1, "a", vec![python("f", "/w.py", 1, 1)]), 1);
        tally.window_mut().add(key(2, 2, "b", vec![python("f", "/w.py", 1, 1)]), 1);
        let snapshot = tally.end_window();
        let mut pids: Vec<u32> = snapshot.rows(FrameView::PythonOnly).iter().map(|row| row.function.pid).collect();
        pids.sort();
        assert_eq!(pids, [1, 2]);
    }
}
