//! The process table: one entry per PID sampled, with everything the sample path keeps of the
//! process as a whole: its name, its identity (its start time) and labels. An entry lives from the
//! process's first sample until its exec or exit event is read (events travel in order with the
//! samples, so its last samples are resolved by then); a periodic check of start times is the
//! safety net for events the kernel dropped. Forgetting a process here and in the holders of its
//! per-process state happens in one place, `Session::forget`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::maps::MapsCache;
use crate::process::comm_to_string;
use crate::stack::ProcessLabels;

/// A process not sampled for this long is checked against /proc (safety net for lost events).
const IDLE_BEFORE_CHECK: Duration = Duration::from_secs(1);

struct Entry {
    /// Read once, so every thread of a process shares one root frame.
    name: Arc<str>,
    /// Set at the first sample the filter keeps.
    sampled: Option<Sampled>,
}

struct Sampled {
    /// `starttime` from /proc/PID/stat: with the PID, the process's identity.
    start_time: Option<u64>,
    labels: Arc<ProcessLabels>,
    last_sample: Instant,
}

#[derive(Default)]
pub struct ProcessTable {
    entries: HashMap<u32, Entry>,
    /// Their maps: the one snapshot per process that the symbolizer, the unwinder and the Python
    /// reader share.
    maps: MapsCache,
}

impl ProcessTable {
    /// The process's `comm`, or `fallback` (the sampled thread's) when it has already exited.
    pub fn name(&mut self, pid: u32, fallback: &[u8]) -> Arc<str> {
        self.entry(pid, fallback).name.clone()
    }

    /// The labels of `pid`, read when it is first sampled.
    pub fn sampled(&mut self, pid: u32) -> Arc<ProcessLabels> {
        let entry = self.entry(pid, &[]);
        let sampled =
            entry.sampled.get_or_insert_with(|| Sampled { start_time: start_time(pid), labels: Arc::new(read_labels(pid)), last_sample: Instant::now() });
        sampled.last_sample = Instant::now();
        sampled.labels.clone()
    }

    fn entry(&mut self, pid: u32, fallback: &[u8]) -> &mut Entry {
        self.entries.entry(pid).or_insert_with(|| {
            let name =
                std::fs::read_to_string(format!("/proc/{pid}/comm")).map(|comm| comm.trim_end().into()).unwrap_or_else(|_| comm_to_string(fallback).into());
            Entry { name, sampled: None }
        })
    }

    pub fn maps(&mut self) -> &mut MapsCache {
        &mut self.maps
    }

    pub fn forget(&mut self, pid: u32) {
        self.entries.remove(&pid);
        self.maps.forget(pid);
    }

    /// Processes idle for a while that are gone, or whose PID now names another process.
    pub fn stale(&self) -> Vec<u32> {
        let stale = |pid: u32, sampled: &Sampled| sampled.last_sample.elapsed() >= IDLE_BEFORE_CHECK && start_time(pid) != sampled.start_time;
        self.entries.iter().filter(|(&pid, entry)| entry.sampled.as_ref().is_some_and(|sampled| stale(pid, sampled))).map(|(&pid, _)| pid).collect()
    }
}

fn start_time(pid: u32) -> Option<u64> {
    procfs::process::Process::new(pid as i32).and_then(|p| p.stat()).ok().map(|stat| stat.starttime)
}

/// The PID inside the process's own PID namespace (when not the host's) and its cgroup.
fn read_labels(pid: u32) -> ProcessLabels {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let ns_pid =
        status.lines().find_map(|line| line.strip_prefix("NSpid:")).and_then(|ids| ids.split_whitespace().last()?.parse().ok()).filter(|&inner| inner != pid);
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok().and_then(|text| cgroup_path(&text)).map(Arc::from);
    ProcessLabels { ns_pid, cgroup }
}

/// The cgroup v2 path (`0::/PATH`); on a host that keeps its containers in v1 hierarchies only
/// (hybrid mode), the first v1 path that is not the root. None in the root cgroup.
fn cgroup_path(text: &str) -> Option<String> {
    let paths: Vec<(&str, &str)> = text.lines().filter_map(|line| line.split_once(':').and_then(|(id, rest)| Some((id, rest.split_once(':')?.1)))).collect();
    let not_root = |path: &&str| *path != "/" && !path.is_empty();
    let v2 = paths.iter().find(|(id, _)| *id == "0").map(|(_, path)| *path).filter(not_root);
    v2.or_else(|| paths.iter().map(|(_, path)| *path).find(not_root)).map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_paths_from_v2_and_v1_files() {
        assert_eq!(cgroup_path("0::/system.slice/docker-abc.scope\n").as_deref(), Some("/system.slice/docker-abc.scope"));
        assert_eq!(cgroup_path("12:cpu,cpuacct:/docker/abc\n0::/\n").as_deref(), Some("/docker/abc"));
        assert_eq!(cgroup_path("12:cpu,cpuacct:/\n0::/\n"), None);
        assert_eq!(cgroup_path("12:cpu,cpuacct:/docker/abc\n").as_deref(), Some("/docker/abc"));
        assert_eq!(cgroup_path("garbage"), None);
    }

    #[test]
    fn this_process_has_its_own_identity_and_no_namespace_pid() {
        let me = std::process::id();
        let mut table = ProcessTable::default();
        assert_eq!(table.sampled(me).ns_pid, None);
        assert!(table.stale().is_empty());
        assert!(start_time(me).is_some());
    }
}
