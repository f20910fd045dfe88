//! speedscope's file format (<https://www.speedscope.app/file-format-schema.json>): one `sampled`
//! profile per process (per thread with `--threads`), each distinct stack once, weighted by the CPU
//! time its samples stand for, in nanoseconds. The heaviest profile opens first.

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Write};

use serde::Serialize;

use crate::stack::{Frame, Profile, Stack};

use super::{frame_name, process_frame, state_frame, thread_frame, Rendering, TRUNCATED_FRAME};

const SCHEMA: &str = "https://www.speedscope.app/file-format-schema.json";

#[derive(Serialize)]
struct File {
    #[serde(rename = "$schema")]
    schema: &'static str,
    shared: Shared,
    profiles: Vec<SampledProfile>,
    name: String,
    #[serde(rename = "activeProfileIndex")]
    active_profile_index: usize,
    exporter: String,
}

#[derive(Serialize)]
struct Shared {
    frames: Vec<FrameEntry>,
}

#[derive(Serialize, Clone, PartialEq, Eq, Hash)]
struct FrameEntry {
    name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    file: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    line: Option<u32>,
}

#[derive(Serialize)]
struct SampledProfile {
    #[serde(rename = "type")]
    kind: &'static str,
    name: String,
    unit: &'static str,
    #[serde(rename = "startValue")]
    start_value: u64,
    #[serde(rename = "endValue")]
    end_value: u64,
    /// Frame indices, root first.
    samples: Vec<Vec<usize>>,
    weights: Vec<u64>,
}

/// Samples per stack (frame indices, root first).
type StackCounts = BTreeMap<Vec<usize>, u64>;

pub(super) fn write(profile: &Profile, rendering: &Rendering, out: &mut dyn Write) -> io::Result<()> {
    serde_json::to_writer(&mut *out, &file(profile, rendering)).map_err(io::Error::other)?;
    out.write_all(b"\n")
}

fn file(profile: &Profile, rendering: &Rendering) -> File {
    let mut frames = FrameTable::default();
    // (pid, tid or 0) -> profile name and samples per stack; sorted, so output is stable.
    let mut grouped: BTreeMap<(u32, u32), (String, StackCounts)> = BTreeMap::new();
    for (key, weight) in profile.stacks() {
        let (group, name) = if rendering.threads {
            ((key.pid, key.tid), format!("{} {}", process_frame(&key), thread_frame(key.tid)))
        } else {
            ((key.pid, 0), process_frame(&key))
        };
        let stacks = &mut grouped.entry(group).or_insert_with(|| (name, BTreeMap::new())).1;
        *stacks.entry(frames.stack(&key)).or_insert(0) += weight.ns;
    }
    let profiles: Vec<SampledProfile> = grouped
        .into_values()
        .map(|(name, stacks)| {
            let (samples, weights): (Vec<_>, Vec<_>) = stacks.into_iter().unzip();
            let end_value = weights.iter().sum();
            SampledProfile { kind: "sampled", name, unit: "nanoseconds", start_value: 0, end_value, samples, weights }
        })
        .collect();
    let active_profile_index = profiles.iter().enumerate().max_by_key(|(_, p)| p.end_value).map_or(0, |(index, _)| index);
    File {
        schema: SCHEMA,
        shared: Shared { frames: frames.entries },
        profiles,
        name: rendering.title.clone(),
        active_profile_index,
        exporter: format!("pyebpf {}", env!("CARGO_PKG_VERSION")),
    }
}

/// speedscope's shared frame list: each distinct frame once.
#[derive(Default)]
struct FrameTable {
    entries: Vec<FrameEntry>,
    index: HashMap<FrameEntry, usize>,
}

impl FrameTable {
    fn intern(&mut self, entry: FrameEntry) -> usize {
        if let Some(&index) = self.index.get(&entry) {
            return index;
        }
        self.entries.push(entry.clone());
        self.index.insert(entry, self.entries.len() - 1);
        self.entries.len() - 1
    }

    /// A sample's frames as indices, root first; a cut Python chain starts at `[truncated]`.
    fn stack(&mut self, key: &Stack<'_>) -> Vec<usize> {
        let mut stack = Vec::with_capacity(key.frames.len() + 1);
        if key.truncated {
            stack.push(self.intern(FrameEntry { name: TRUNCATED_FRAME.to_string(), file: None, line: None }));
        }
        stack.extend(key.frames.iter().rev().map(|frame| self.intern(entry(frame))));
        if let Some(state) = state_frame(key.state) {
            stack.push(self.intern(FrameEntry { name: state, file: None, line: None }));
        }
        stack
    }
}

fn entry(frame: &Frame) -> FrameEntry {
    let (file, line) = match frame {
        Frame::Python(python) => (Some(python.filename.to_string()), python.line),
        Frame::Native(native) => (native.file.as_deref().map(str::to_string), native.line.unwrap_or(0)),
        Frame::Kernel(_) | Frame::Task(_) => (None, 0),
    };
    FrameEntry { name: frame_name(frame).into_owned(), file, line: (line != 0).then_some(line) }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::Value;

    use super::super::test_profile::sample_profile;
    use super::*;
    use crate::stack::StackKey;

    fn render(threads: bool) -> Value {
        let mut profile = sample_profile();
        let (stack, _) = profile.stacks().find(|(k, _)| k.pid == 200).unwrap();
        let truncated = StackKey {
            pid: stack.pid,
            tid: stack.tid,
            comm: stack.comm.into(),
            frames: stack.frames.iter().cloned().collect(),
            truncated: true,
            labels: stack.labels.cloned().map(Arc::new),
            state: stack.state,
        };
        profile.add(truncated, 1);
        let mut out = Vec::new();
        write(&profile, &Rendering { threads, title: "pyebpf record -a".into() }, &mut out).unwrap();
        serde_json::from_slice(&out).unwrap()
    }

    fn frame_names(file: &Value, stack: &Value) -> Vec<String> {
        let frames = file["shared"]["frames"].as_array().unwrap();
        stack.as_array().unwrap().iter().map(|i| frames[i.as_u64().unwrap() as usize]["name"].as_str().unwrap().to_string()).collect()
    }

    #[test]
    fn one_sampled_profile_per_process_weighted_in_nanoseconds() {
        let file = render(false);
        assert_eq!(file["$schema"], SCHEMA);
        let profiles = file["profiles"].as_array().unwrap();
        let names: Vec<_> = profiles.iter().map(|p| p["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["app (100)", "busy;loop (200)"]);
        for profile in profiles {
            assert_eq!(profile["type"], "sampled");
            assert_eq!(profile["unit"], "nanoseconds");
            let weights: u64 = profile["weights"].as_array().unwrap().iter().map(|w| w.as_u64().unwrap()).sum();
            assert_eq!(profile["samples"].as_array().unwrap().len(), profile["weights"].as_array().unwrap().len());
            assert_eq!(profile["endValue"].as_u64().unwrap(), weights);
        }
        // 10 samples of app's two threads merge into one stack; 100 Hz is 10 ms a sample.
        assert_eq!(profiles[0]["weights"], serde_json::json!([100_000_000]));
        assert_eq!(
            frame_names(&file, &profiles[0]["samples"][0]),
            ["_start", "main (/srv/work.py:33)", "Worker.compute (/srv/work.py:14)", "libfoo.so+0x1234", "do_syscall_64_[k]"]
        );
        assert_eq!(file["activeProfileIndex"], 0);
    }

    #[test]
    fn python_frames_carry_file_and_line_and_a_cut_chain_starts_truncated() {
        let file = render(false);
        let frames = file["shared"]["frames"].as_array().unwrap();
        let compute = frames.iter().find(|f| f["name"] == "Worker.compute (/srv/work.py:14)").unwrap();
        assert_eq!(compute["file"], "/srv/work.py");
        assert_eq!(compute["line"], 14);
        let busy = &file["profiles"][1];
        let stacks: Vec<_> = busy["samples"].as_array().unwrap().iter().map(|s| frame_names(&file, s)).collect();
        assert!(stacks.contains(&vec!["[truncated]".to_string(), "main".into(), "leaf_fn".into()]), "{stacks:?}");
    }

    #[test]
    fn threads_get_a_profile_each() {
        let file = render(true);
        let names: Vec<_> = file["profiles"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap().to_string()).collect();
        assert_eq!(names, ["app (100) thread 100", "app (100) thread 101", "busy;loop (200) thread 200"]);
    }
}
