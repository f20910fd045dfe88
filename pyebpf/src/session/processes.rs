//! The process table: one entry per PID sampled, with everything the sample path keeps of the
//! process as a whole: its name, its identity (its start time) and labels. An entry lives from the
//! process's first sample until its exec or exit event is read (events travel in order with the
//! samples, so its last samples are resolved by then); a periodic check of start times is the
//! safety net for events the kernel dropped. Forgetting a process here and in the holders of its
//! per-process state happens in one place, `Session::forget`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::kernel_maps::KernelMaps;
use crate::maps::MapsCache;
use crate::process::{comm_to_string, own_namespace_id};
use crate::stack::{ProcessDetails, ProcessLabels};

/// A process not sampled for this long is checked against /proc (safety net for lost events).
const IDLE_BEFORE_CHECK: Duration = Duration::from_secs(1);

struct Entry {
    /// Read once, so every thread of a process shares one root frame.
    name: Arc<str>,
    /// The eBPF program was told the process is known (`KNOWN_PROCS`).
    known: bool,
    /// Set at the first sample the filter keeps.
    sampled: Option<Sampled>,
}

struct Sampled {
    /// `starttime` from /proc/PID/stat: with the PID, the process's identity.
    start_time: Option<u64>,
    labels: Arc<ProcessLabels>,
    first_sample: Instant,
    last_sample: Instant,
}

/// Which details of a process are read at its first sample, for `record --otlp`.
#[derive(Clone, Debug, Default)]
pub struct DetailsWanted {
    /// The environment variable `--service-name env:VAR` names the service by.
    pub env_var: Option<String>,
}

/// The most of /proc/PID/environ read: a process's environment can be large, and only one
/// variable is looked for.
const MAX_ENVIRON_BYTES: u64 = 256 * 1024;

#[derive(Default)]
pub struct ProcessTable {
    entries: HashMap<u32, Entry>,
    /// None unless `record --otlp` names processes by more than their labels.
    details: Option<DetailsWanted>,
    /// Their maps: the one snapshot per process that the symbolizer, the unwinder and the Python
    /// reader share.
    maps: MapsCache,
}

impl ProcessTable {
    pub fn with_details(details: Option<DetailsWanted>) -> Self {
        ProcessTable { details, ..ProcessTable::default() }
    }

    /// The process's `comm`, or `fallback` (the sampled thread's) when it has already exited.
    pub fn name(&mut self, pid: u32, fallback: &[u8]) -> Arc<str> {
        self.entry(pid, fallback).name.clone()
    }

    /// The labels of `pid`, read when it is first sampled (with the details wanted, and the
    /// CPython version `python_version` gives).
    pub fn sampled(&mut self, pid: u32, python_version: impl FnOnce() -> Option<String>) -> Arc<ProcessLabels> {
        if let Some(sampled) = self.entries.get_mut(&pid).and_then(|entry| entry.sampled.as_mut()) {
            sampled.last_sample = Instant::now();
            return sampled.labels.clone();
        }
        let mut labels = read_labels(pid);
        let wanted = self.details.as_ref().map(|wanted| wanted.env_var.as_deref());
        labels.details = wanted.map(|env_var| Arc::new(read_details(pid, env_var, python_version())));
        let labels = Arc::new(labels);
        let now = Instant::now();
        let start_time = start_time(pid);
        self.entry(pid, &[]).sampled = Some(Sampled { start_time, labels: labels.clone(), first_sample: now, last_sample: now });
        labels
    }

    /// Whether the eBPF program was told `pid` is known.
    pub fn is_known(&self, pid: u32) -> bool {
        self.entries.get(&pid).is_some_and(|entry| entry.known)
    }

    /// How long since the first sample of `pid` the filter kept (zero before it).
    pub fn sampled_for(&self, pid: u32) -> Duration {
        self.entries.get(&pid).and_then(|entry| entry.sampled.as_ref()).map_or(Duration::ZERO, |sampled| sampled.first_sample.elapsed())
    }

    fn entry(&mut self, pid: u32, fallback: &[u8]) -> &mut Entry {
        self.entries.entry(pid).or_insert_with(|| {
            let name =
                std::fs::read_to_string(format!("/proc/{pid}/comm")).map(|comm| comm.trim_end().into()).unwrap_or_else(|_| comm_to_string(fallback).into());
            Entry { name, known: false, sampled: None }
        })
    }

    pub fn maps(&mut self) -> &mut MapsCache {
        &mut self.maps
    }

    /// Tells the eBPF program once that `pid`'s samples need not reach userspace soon: what they
    /// need of the live process was read (its classification, its Python state).
    pub fn known(&mut self, pid: u32, kernel: &mut dyn KernelMaps) {
        let entry = self.entry(pid, &[]);
        if !entry.known {
            entry.known = true;
            kernel.set_known(pid, true);
        }
    }

    /// Withdraws what [`Self::known`] told: a process found to be Python after it was known (a
    /// `libpython` mapped late) must have its first samples as one soon again.
    pub fn unknown(&mut self, pid: u32, kernel: &mut dyn KernelMaps) {
        if let Some(entry) = self.entries.get_mut(&pid).filter(|entry| entry.known) {
            entry.known = false;
            kernel.set_known(pid, false);
        }
    }

    pub fn forget(&mut self, pid: u32, kernel: &mut dyn KernelMaps) {
        if self.entries.remove(&pid).is_some_and(|entry| entry.known) {
            kernel.set_known(pid, false);
        }
        self.maps.forget(pid);
    }

    /// Processes idle for a while that are gone, or whose PID now names another process.
    pub fn stale(&self) -> Vec<u32> {
        let stale = |pid: u32, sampled: &Sampled| sampled.last_sample.elapsed() >= IDLE_BEFORE_CHECK && start_time(pid) != sampled.start_time;
        self.entries.iter().filter(|(&pid, entry)| entry.sampled.as_ref().is_some_and(|sampled| stale(pid, sampled))).map(|(&pid, _)| pid).collect()
    }
}

fn start_time(pid: u32) -> Option<u64> {
    crate::process::stat(pid).ok().map(|stat| stat.starttime)
}

/// The PID inside the process's own PID namespace (when not the host's) and its cgroup.
fn read_labels(pid: u32) -> ProcessLabels {
    let ns_pid = own_namespace_id(pid, None).filter(|&inner| inner != pid);
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok().and_then(|text| cgroup_path(&text)).map(Arc::from);
    ProcessLabels { ns_pid, cgroup, details: None }
}

/// The executable, the value of `env_var` and the CPython version of `pid`.
fn read_details(pid: u32, env_var: Option<&str>, python_version: Option<String>) -> ProcessDetails {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok().map(|path| Arc::from(path.to_string_lossy().as_ref()));
    let env_value = env_var.and_then(|name| environ_value(pid, name)).map(Arc::from);
    ProcessDetails { exe, env_value, python_version: python_version.map(Arc::from) }
}

/// The value of `name` in the environment the process started with (at most
/// [`MAX_ENVIRON_BYTES`] of it are read).
fn environ_value(pid: u32, name: &str) -> Option<String> {
    use std::io::Read;
    let mut environ = Vec::new();
    std::fs::File::open(format!("/proc/{pid}/environ")).ok()?.take(MAX_ENVIRON_BYTES).read_to_end(&mut environ).ok()?;
    find_variable(&environ, name)
}

/// `name`'s value among NUL-separated `NAME=VALUE` entries.
fn find_variable(environ: &[u8], name: &str) -> Option<String> {
    environ
        .split(|&b| b == 0)
        .find_map(|entry| entry.strip_prefix(name.as_bytes())?.strip_prefix(b"="))
        .map(|value| String::from_utf8_lossy(value).into_owned())
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
    fn details_name_the_executable_the_variable_and_the_python() {
        std::env::set_var("PYEBPF_TEST_SERVICE", "checkout");
        let me = std::process::id();
        let mut table = ProcessTable::with_details(Some(DetailsWanted { env_var: Some("PYEBPF_TEST_SERVICE".into()) }));
        let labels = table.sampled(me, || Some("3.12.1".into()));
        let details = labels.details.as_deref().unwrap();
        assert_eq!(details.exe.as_deref(), std::env::current_exe().ok().map(|exe| exe.to_string_lossy().into_owned()).as_deref());
        assert_eq!(details.python_version.as_deref(), Some("3.12.1"));
        // The environment the process started with: set_var does not change /proc/PID/environ.
        assert_eq!(find_variable(b"A=1\0SERVICE=x=y\0SERVICE_B=2\0", "SERVICE").as_deref(), Some("x=y"));
        assert_eq!(find_variable(b"SERVICEX=1\0", "SERVICE"), None);
        assert_eq!(find_variable(b"", "SERVICE"), None);
    }

    #[test]
    fn this_process_has_its_own_identity_and_no_namespace_pid() {
        let me = std::process::id();
        let mut table = ProcessTable::default();
        assert_eq!(table.sampled(me, || None).ns_pid, None);
        assert!(table.sampled(me, || None).details.is_none());
        assert!(table.stale().is_empty());
        assert!(start_time(me).is_some());
    }
}
