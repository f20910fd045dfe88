//! Collapsed stacks, the input of flamegraph.pl and inferno: one line per distinct stack,
//! `ROOT;...;LEAF VALUE`, with the root frame `COMM (PID)`. The value is a sample count, or with
//! `--mode wall` and `off-cpu` microseconds, and off-CPU stacks end in `[off-cpu REASON]`.

use std::collections::BTreeMap;
use std::io::{self, Write};

use crate::stack::{Profile, Stack};

use super::{frame_name, process_frame, state_frame, text_value, thread_frame, TRUNCATED_FRAME};

pub(super) fn write(profile: &Profile, threads: bool, out: &mut impl Write) -> io::Result<()> {
    for (stack, count) in merged_lines(profile, threads) {
        writeln!(out, "{stack} {count}")?;
    }
    Ok(())
}

/// Rendered stacks with their values; unless `threads`, threads of one process that share a stack
/// become one line. Sorted, so equal profiles give byte-equal files.
pub(super) fn merged_lines(profile: &Profile, threads: bool) -> BTreeMap<String, u64> {
    let mut lines = BTreeMap::new();
    for (key, weight) in profile.stacks() {
        let count = text_value(profile, weight);
        if count == 0 {
            continue;
        }
        let mut line = render_stack(&key, threads);
        if profile.group_by_container {
            line.insert_str(0, &format!("{};", sanitize(&container_frame(&key))));
        }
        *lines.entry(line).or_insert(0) += count;
    }
    lines
}

/// The root frame of `--group-by container`: the cgroup path, or `[host]` outside any.
fn container_frame(key: &Stack<'_>) -> String {
    match key.labels.and_then(|labels| labels.cgroup.as_deref()) {
        Some(cgroup) => format!("[cgroup {cgroup}]"),
        None => "[host]".to_string(),
    }
}

fn render_stack(key: &Stack<'_>, threads: bool) -> String {
    let mut line = sanitize(&process_frame(key));
    if threads {
        line.push(';');
        line.push_str(&thread_frame(key.tid));
    }
    if key.truncated {
        line.push(';');
        line.push_str(TRUNCATED_FRAME);
    }
    for frame in key.frames.iter().rev() {
        line.push(';');
        line.push_str(&sanitize(&frame_name(frame)));
    }
    if let Some(state) = state_frame(key.state) {
        line.push(';');
        line.push_str(&state);
    }
    line
}

/// Names may hold `;` (C++ templates, comms) or line breaks, which would split a frame or a line.
pub(super) fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| match c {
            ';' => ':',
            '\n' | '\r' => ' ',
            c => c,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::test_profile::{key, native, sample_profile};
    use super::*;

    fn render(profile: &Profile) -> String {
        let mut out = Vec::new();
        write(profile, false, &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn one_sorted_line_per_stack_root_first_threads_merged() {
        let expected = "\
app (100);_start;main (/srv/work.py:33);Worker.compute (/srv/work.py:14);libfoo.so+0x1234;do_syscall_64_[k] 10
busy:loop (200);main;leaf_fn 5
";
        assert_eq!(render(&sample_profile()), expected);
    }

    #[test]
    fn threads_get_a_frame_under_their_process() {
        let text = {
            let mut out = Vec::new();
            write(&sample_profile(), true, &mut out).unwrap();
            String::from_utf8(out).unwrap()
        };
        assert!(text.contains("app (100);thread 100;_start;"), "{text}");
        assert!(text.contains("app (100);thread 101;_start;"), "{text}");
        assert!(text.contains(" 7\n") && text.contains(" 3\n"), "{text}");
    }

    #[test]
    fn every_line_parses_whatever_the_names_hold() {
        let exe = super::super::test_profile::module("/bin/x", 0x1000);
        let mut profile = Profile::new(99);
        profile.add(key(1, 1, "we\nird", vec![native(&exe, 0x1000, Some("f<a;b>\r\ng"))]), 2);
        let text = render(&profile);
        assert_eq!(text, "we ird (1);f<a:b>  g 2\n");
        for line in text.lines() {
            let (stack, count) = line.rsplit_once(' ').unwrap();
            assert!(count.parse::<u64>().is_ok());
            assert_eq!(stack.split(';').count(), 2);
        }
    }
}
