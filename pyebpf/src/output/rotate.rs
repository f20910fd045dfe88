//! `--rotate`: the names of the files a rotating recording writes, one per period.
//!
//! Each period's file is `-o`'s name with the period's UTC start inserted before the extension:
//! `profile.pb.gz` → `profile.20261123T120000.pb.gz`. A file already at that name was not made by
//! this period, so it is never replaced: the name gets `-1`, `-2`, ... instead. With `--keep N`,
//! only the newest N files of that pattern stay; pyebpf removes only regular files named so.

use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use super::destination::parent_dir;
use super::OutputError;

/// Extensions of more than one part that stay whole after the timestamp.
const DOUBLE_EXTENSIONS: [&[u8]; 1] = [b".pb.gz"];

/// How many `-N` suffixes are tried before giving up on a name.
const MAX_ATTEMPTS: u32 = 100;

/// A name next to `path` for the period that started at `start_unix_ns`, where nothing is yet.
pub fn free_name(path: &Path, start_unix_ns: i64) -> Result<PathBuf, OutputError> {
    let stamp = timestamp(start_unix_ns);
    for attempt in 0..MAX_ATTEMPTS {
        let candidate = rotated_name(path, &stamp, attempt);
        match std::fs::symlink_metadata(&candidate) {
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(candidate),
            Err(err) => return Err(OutputError::Io { path: candidate, cause: err }),
            Ok(_) => continue,
        }
    }
    let cause = io::Error::new(io::ErrorKind::AlreadyExists, "every name for this period is taken");
    Err(OutputError::Io { path: rotated_name(path, &stamp, 0), cause })
}

/// Removes the oldest files a rotating recording to `path` left (this run's or an earlier run's)
/// until `keep` remain; returns those it removed.
pub fn remove_oldest(path: &Path, keep: usize) -> Result<Vec<PathBuf>, OutputError> {
    let dir = parent_dir(path);
    let io_error = |cause| OutputError::Io { path: dir.to_path_buf(), cause };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_error)? {
        let entry = entry.map_err(io_error)?;
        let name = entry.file_name();
        // `file_type` does not follow links: a link or a FIFO named like a period is not ours.
        if let Some(order) = period_order(path, name.as_bytes()) {
            if entry.file_type().is_ok_and(|kind| kind.is_file()) {
                files.push((order, entry.path()));
            }
        }
    }
    files.sort();
    let excess = files.len().saturating_sub(keep);
    let mut removed = Vec::with_capacity(excess);
    for (_, file) in files.into_iter().take(excess) {
        match std::fs::remove_file(&file) {
            Ok(()) => removed.push(file),
            Err(err) if err.kind() == io::ErrorKind::NotFound => {}
            Err(cause) => return Err(OutputError::Io { path: file, cause }),
        }
    }
    Ok(removed)
}

/// Where a file named `name` stands among the periods of a recording to `path`: its timestamp and
/// attempt, if it is named `STEM.YYYYMMDDTHHMMSS[-N]EXT` after `path`.
fn period_order(path: &Path, name: &[u8]) -> Option<(Vec<u8>, u32)> {
    let (stem, extension) = split_extension(path.file_name().map_or(&[][..], OsStr::as_bytes));
    let middle = name.strip_prefix(stem)?.strip_prefix(b".")?.strip_suffix(extension)?;
    let (stamp, attempt) = match middle.iter().position(|&b| b == b'-') {
        Some(dash) => (&middle[..dash], std::str::from_utf8(&middle[dash + 1..]).ok()?.parse().ok().filter(|&n| n > 0)?),
        None => (middle, 0),
    };
    let is_stamp = stamp.len() == 15 && stamp.iter().enumerate().all(|(i, &b)| if i == 8 { b == b'T' } else { b.is_ascii_digit() });
    is_stamp.then(|| (stamp.to_vec(), attempt))
}

/// `20261123T120000`, in UTC.
fn timestamp(unix_ns: i64) -> String {
    let seconds = unix_ns.div_euclid(1_000_000_000);
    jiff::Timestamp::from_second(seconds).unwrap_or(jiff::Timestamp::UNIX_EPOCH).strftime("%Y%m%dT%H%M%S").to_string()
}

/// `DIR/STEM.STAMP[-ATTEMPT]EXT`.
fn rotated_name(path: &Path, stamp: &str, attempt: u32) -> PathBuf {
    let name = path.file_name().map_or(&[][..], OsStr::as_bytes);
    let (stem, extension) = split_extension(name);
    let mut rotated = stem.to_vec();
    rotated.push(b'.');
    rotated.extend_from_slice(stamp.as_bytes());
    if attempt > 0 {
        rotated.extend_from_slice(format!("-{attempt}").as_bytes());
    }
    rotated.extend_from_slice(extension);
    path.with_file_name(OsStr::from_bytes(&rotated))
}

/// A file name's stem and extension (with its dot); a leading dot starts no extension.
fn split_extension(name: &[u8]) -> (&[u8], &[u8]) {
    if let Some(ext) = DOUBLE_EXTENSIONS.iter().find(|ext| name.len() > ext.len() && name.ends_with(ext)) {
        return name.split_at(name.len() - ext.len());
    }
    match name.iter().rposition(|&b| b == b'.') {
        Some(dot) if dot > 0 => name.split_at(dot),
        _ => (name, &[]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2026-11-23 12:34:56 UTC.
    const START_NS: i64 = 1_795_437_296_000_000_123;

    #[test]
    fn the_timestamp_goes_before_the_extension() {
        let cases = [
            ("/tmp/out.pb.gz", "/tmp/out.20261123T123456.pb.gz"),
            ("out.folded", "out.20261123T123456.folded"),
            ("my.run.txt", "my.run.20261123T123456.txt"),
            ("profile", "profile.20261123T123456"),
            (".hidden", ".hidden.20261123T123456"),
            ("x.pb.gz.folded", "x.pb.gz.20261123T123456.folded"),
        ];
        for (path, expected) in cases {
            assert_eq!(rotated_name(Path::new(path), &timestamp(START_NS), 0), PathBuf::from(expected), "{path}");
        }
        assert_eq!(rotated_name(Path::new("a.pb.gz"), "S", 2), PathBuf::from("a.S-2.pb.gz"));
    }

    #[test]
    fn an_existing_file_is_never_the_name_chosen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.folded");
        let first = free_name(&path, START_NS).unwrap();
        assert_eq!(first, dir.path().join("p.20261123T123456.folded"));
        std::fs::write(&first, "mine").unwrap();
        let second = free_name(&path, START_NS).unwrap();
        assert_eq!(second, dir.path().join("p.20261123T123456-1.folded"));
        assert_eq!(std::fs::read_to_string(&first).unwrap(), "mine");
    }

    #[test]
    fn the_oldest_periods_go_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.pb.gz");
        let periods =
            ["p.20261123T120000.pb.gz", "p.20261123T120100.pb.gz", "p.20261123T120100-2.pb.gz", "p.20261123T120100-10.pb.gz", "p.20261123T120200.pb.gz"];
        // Named almost like periods, or like one but not a regular file: never removed.
        let others = [
            "p.pb.gz",
            "p.2026112T120000.pb.gz",
            "p.20261123T120000-0.pb.gz",
            "q.20261123T115900.pb.gz",
            "p.20261123T115900.folded",
            "p.20261123X115900.pb.gz",
        ];
        for name in periods.iter().chain(&others) {
            std::fs::write(dir.path().join(name), name).unwrap();
        }
        std::os::unix::fs::symlink(dir.path().join("p.pb.gz"), dir.path().join("p.20261123T115800.pb.gz")).unwrap();
        std::fs::create_dir(dir.path().join("p.20261123T115700.pb.gz")).unwrap();
        let removed = remove_oldest(&path, 2).unwrap();
        assert_eq!(removed, periods[..3].iter().map(|name| dir.path().join(name)).collect::<Vec<_>>());
        let mut left: Vec<String> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        let mut expected: Vec<&str> = periods[3..].iter().chain(&others).copied().chain(["p.20261123T115800.pb.gz", "p.20261123T115700.pb.gz"]).collect();
        expected.sort();
        assert_eq!(left, expected);
        assert!(remove_oldest(&path, 2).unwrap().is_empty());
    }
}
