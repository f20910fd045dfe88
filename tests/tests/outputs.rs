//! Issue 12: what users open and read. A flame graph SVG that a real browser (headless Chromium)
//! renders with the Python functions in it, a speedscope file that keeps speedscope's format, the
//! `--function` and `--threads` views, the summary at the end of `record`, the filters, and the
//! output's owner under sudo. All on real interpreters running known workloads.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use pyebpf_tests::{assert_one_line_error, debian_python, pyebpf, pyebpf_command, start_ready, Killed};

const HZ: u64 = 99;

/// `pyebpf record -p PID -d SECONDS -F 99 -o OUT EXTRA...`, which must succeed; returns stderr.
fn record_pid(pid: u32, seconds: &str, out: &Path, extra: &[&str]) -> String {
    let output = pyebpf_command().args(["record", "-p", &pid.to_string(), "-d", seconds, "-F", &HZ.to_string(), "-o"]).arg(out).args(extra).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "pyebpf record failed: {stderr}");
    stderr
}

/// N in the summary's first line `pyebpf: wrote N samples of ...`.
fn samples_written(stderr: &str) -> u64 {
    let line = stderr.lines().find(|line| line.starts_with("pyebpf: wrote ")).unwrap_or_else(|| panic!("no summary: {stderr}"));
    let samples = line["pyebpf: wrote ".len()..].split(' ').next().unwrap().parse().unwrap();
    assert!(samples > 0, "nothing sampled, so nothing is tested: {stderr}");
    samples
}

/// Chromium's DOM after it loaded `page` headless, with a profile directory of its own.
fn chromium_dom(page: &Path) -> String {
    chromium_dom_of(&format!("file://{}", page.display()), &[])
}

/// Chromium's DOM after it loaded `url` headless (with `extra` flags), with a profile directory
/// of its own.
fn chromium_dom_of(url: &str, extra: &[&str]) -> String {
    let profile = tempfile::tempdir().unwrap();
    let output = Command::new("timeout")
        .args(["120", "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        .args(["--disable-component-update", "--disable-sync", "--no-first-run"])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(extra)
        .arg("--dump-dom")
        .arg(url)
        .output()
        .expect("chromium (Debian's chromium package) must be installed; cargo xtask test installs it");
    assert!(output.status.success(), "chromium failed: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Every `<g><title>NAME (...)</title><rect ... fill="rgb(R,G,B)"` of a flame graph as (NAME, RGB).
fn frame_fills(svg: &str) -> Vec<(String, [u8; 3])> {
    svg.split("<title>")
        .skip(1)
        .filter_map(|part| {
            let (title, rest) = part.split_once("</title>")?;
            let name = title.rsplit_once(" (").map_or(title, |(name, _)| name).to_string();
            let fill = rest.split_once("fill=\"rgb(")?.1.split_once(')')?.0;
            let rgb: Vec<u8> = fill.split(',').map(|c| c.trim().parse().unwrap()).collect();
            Some((name, [rgb[0], rgb[1], rgb[2]]))
        })
        .collect()
}

#[test]
fn svg_flame_graph_renders_in_chromium_with_the_python_functions_coloured_apart() {
    let (python, _ready) = start_ready(&debian_python("3.14"), "sampling_proportions.py", &[]);
    let dir = tempfile::tempdir().unwrap();
    let svg_path = dir.path().join("flame.svg");
    let stderr = record_pid(python.pid(), "3", &svg_path, &[]);
    let samples = samples_written(&stderr);
    let svg = fs::read_to_string(&svg_path).unwrap();
    assert!(svg.contains(&format!("{samples} samples at {HZ} Hz")), "subtitle lacks the sample count");
    assert!(svg.contains("pyebpf record -p"), "title is not the command line");

    let dom = chromium_dom(&svg_path);
    for function in ["sixty_percent", "thirty_percent", "ten_percent", "spin"] {
        assert!(dom.contains(function), "the rendered page lacks {function}");
    }
    // inferno's script ran in the browser: on load it drops the fixed width and viewBox of the
    // <svg> element, which the file has, so the graph fits the window.
    let svg_tag = |text: &str| text[text.find("<svg").unwrap()..].split_once('>').unwrap().0.to_string();
    assert!(svg_tag(&svg).contains("viewBox="), "{}", svg_tag(&svg));
    assert!(!svg_tag(&dom).contains("viewBox="), "inferno's script did not run: {}", svg_tag(&dom));

    let fills = frame_fills(&svg);
    let python_fills: Vec<_> = fills.iter().filter(|(name, _)| name.contains(".py:")).collect();
    let native_fills: Vec<_> =
        fills.iter().filter(|(name, _)| !name.contains(".py") && !name.ends_with(&format!("({})", python.pid())) && name != "all").collect();
    assert!(!python_fills.is_empty() && !native_fills.is_empty(), "need Python and native frames: {fills:?}");
    for (name, [r, _, b]) in &python_fills {
        assert!(b > r, "Python frame {name} is not blue");
    }
    for (name, [r, _, b]) in &native_fills {
        assert!(r > b, "native frame {name} is coloured like Python");
    }
}

#[test]
fn speedscope_file_keeps_the_format_and_weighs_samples_in_nanoseconds() {
    let (python, _ready) = start_ready(&debian_python("3.14"), "sampling_proportions.py", &[]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.speedscope.json");
    let samples = samples_written(&record_pid(python.pid(), "3", &path, &[]));
    let file: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).expect("speedscope file is not JSON");
    assert_eq!(file["$schema"], "https://www.speedscope.app/file-format-schema.json");
    let frames = file["shared"]["frames"].as_array().expect("shared.frames");
    assert!(frames.iter().all(|f| f["name"].is_string()), "a frame without a name");
    let names: Vec<&str> = frames.iter().map(|f| f["name"].as_str().unwrap()).collect();
    for function in ["sixty_percent", "thirty_percent", "ten_percent"] {
        assert!(names.iter().any(|name| name.starts_with(&format!("{function} ("))), "no {function} frame: {names:?}");
    }
    let profiles = file["profiles"].as_array().expect("profiles");
    assert_eq!(profiles.len(), 1, "one process, one profile");
    let mut weight_sum = 0;
    for profile in profiles {
        assert_eq!(profile["type"], "sampled");
        assert_eq!(profile["unit"], "nanoseconds");
        let stacks = profile["samples"].as_array().unwrap();
        let weights = profile["weights"].as_array().unwrap();
        assert_eq!(stacks.len(), weights.len());
        for stack in stacks {
            assert!(stack.as_array().unwrap().iter().all(|i| (i.as_u64().unwrap() as usize) < frames.len()), "frame index out of range");
        }
        let sum: u64 = weights.iter().map(|w| w.as_u64().unwrap()).sum();
        assert_eq!(profile["endValue"].as_u64().unwrap() - profile["startValue"].as_u64().unwrap(), sum);
        weight_sum += sum;
    }
    assert_eq!(weight_sum, samples * (1_000_000_000 / HZ), "weights are not samples × period");
    assert!(file["activeProfileIndex"].as_u64().unwrap() < profiles.len() as u64);
}

/// The speedscope release the acceptance test loads files with (the npm package `speedscope`).
const SPEEDSCOPE_VERSION: &str = "1.25.0";

/// speedscope's published package, installed with npm once into a cache directory; returns the
/// package's directory.
fn speedscope_package() -> PathBuf {
    let home = std::env::var("HOME").expect("HOME must be set");
    let cache = Path::new(&home).join(".cache/pyebpf-test-npm").join(format!("speedscope-{SPEEDSCOPE_VERSION}"));
    let package = cache.join("node_modules/speedscope");
    if package.join("dist/release/index.html").exists() {
        return package;
    }
    // Installed beside the cache and moved into place, so an interrupted install is never taken
    // for a complete one.
    fs::create_dir_all(cache.parent().unwrap()).unwrap();
    let staging = tempfile::tempdir_in(cache.parent().unwrap()).unwrap();
    let output = Command::new("npm")
        .args(["install", "--no-save", "--no-audit", "--no-fund", "--prefix"])
        .arg(staging.path())
        .arg(format!("speedscope@{SPEEDSCOPE_VERSION}"))
        .output()
        .expect("npm must be installed (Debian's npm; cargo xtask test installs it)");
    assert!(
        output.status.success(),
        "cannot install speedscope@{SPEEDSCOPE_VERSION} from the npm registry (is it reachable?): {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let _ = fs::remove_dir_all(&cache);
    fs::rename(staging.keep(), &cache).unwrap();
    assert!(package.join("dist/release/index.html").exists(), "speedscope@{SPEEDSCOPE_VERSION} has no dist/release/index.html");
    package
}

#[test]
fn speedscope_file_loads_in_speedscopes_own_importer() {
    let (python, _ready) = start_ready(&debian_python("3.14"), "sampling_proportions.py", &[]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.speedscope.json");
    samples_written(&record_pid(python.pid(), "3", &path, &[]));
    let package = speedscope_package();

    // What `speedscope FILE` (the package's bin/cli.mjs) does: a script that hands the file,
    // base64-encoded, to the app's loadFileFromBase64, named by #localProfilePath. The app then
    // imports it with its own importer; #view=sandwich lists every function as HTML.
    let encoded = Command::new("base64").arg("-w0").arg(&path).output().unwrap();
    assert!(encoded.status.success());
    let loader = dir.path().join("load.js");
    let file_name = serde_json::to_string("run.speedscope.json").unwrap();
    fs::write(&loader, format!("speedscope.loadFileFromBase64({file_name}, \"{}\")", String::from_utf8(encoded.stdout).unwrap().trim())).unwrap();
    let page = package.join("dist/release/index.html");
    let url = format!("file://{}#localProfilePath={}&view=sandwich", page.display(), loader.display());
    let dom = chromium_dom_of(&url, &["--virtual-time-budget=10000"]);

    assert!(!dom.contains("Something went wrong"), "speedscope could not import the file: {dom}");
    assert!(dom.contains(&format!("python3.14 ({})", python.pid())), "speedscope shows no profile of the process: {dom}");
    assert!(dom.contains("Symbol Name"), "the sandwich view's table is missing: {dom}");
    for function in ["sixty_percent", "thirty_percent", "ten_percent", "spin"] {
        assert!(dom.contains(&format!(">{function} (")), "speedscope's function table lacks {function}");
    }
    // Weights in nanoseconds show as time (`777.78ms (55%)`), not as bare numbers.
    assert!(dom.contains("ms ("), "speedscope did not read the weights as time: {dom}");
}

#[test]
fn threads_get_their_own_speedscope_profiles_and_collapsed_frames() {
    let (python, _ready) = start_ready(&debian_python("3.14"), "two_spinners.py", &[]);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("threads.speedscope.json");
    record_pid(python.pid(), "2", &path, &["--threads"]);
    let file: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    let profiles = file["profiles"].as_array().unwrap();
    let spinning: Vec<&str> =
        profiles.iter().filter(|p| p["endValue"].as_u64().unwrap() >= 50 * (1_000_000_000 / HZ)).map(|p| p["name"].as_str().unwrap()).collect();
    assert_eq!(spinning.len(), 2, "the two spinning threads were not kept apart: {profiles:?}");
    let process = format!("python3.14 ({}) thread ", python.pid());
    assert!(spinning.iter().all(|name| name.starts_with(&process)), "{spinning:?}");

    let folded = dir.path().join("threads.folded");
    record_pid(python.pid(), "2", &folded, &["--threads"]);
    let text = fs::read_to_string(&folded).unwrap();
    assert!(text.lines().all(|line| line.split(';').nth(1).is_some_and(|frame| frame.starts_with("thread "))), "{text}");
    let threads: std::collections::HashSet<&str> = text.lines().filter(|l| l.contains("spin (")).map(|l| l.split(';').nth(1).unwrap()).collect();
    assert_eq!(threads.len(), 2, "{text}");
}

#[test]
fn function_mode_merges_lines() {
    let (python, _ready) = start_ready(&debian_python("3.14"), "sampling_proportions.py", &[]);
    let dir = tempfile::tempdir().unwrap();
    let by_line = dir.path().join("lines.folded");
    let by_function = dir.path().join("functions.folded");
    record_pid(python.pid(), "2", &by_line, &[]);
    record_pid(python.pid(), "2", &by_function, &["--function"]);
    let python_frames = |path: &Path| -> Vec<String> {
        let text = fs::read_to_string(path).unwrap();
        text.lines()
            .flat_map(|line| line.rsplit_once(' ').unwrap().0.split(';').skip(1).map(str::to_string).collect::<Vec<_>>())
            .filter(|f| f.contains(".py"))
            .collect()
    };
    let lines = python_frames(&by_line);
    assert!(lines.iter().any(|f| f.contains(".py:")), "the default keeps lines: {lines:?}");
    let functions = python_frames(&by_function);
    assert!(functions.iter().any(|f| f.starts_with("spin (") && f.ends_with("sampling_proportions.py)")), "{functions:?}");
    assert!(functions.iter().all(|f| !f.contains(".py:")), "a Python frame kept its line: {functions:?}");
}

#[test]
fn summary_names_the_hottest_function_with_its_share() {
    let (python, _ready) = start_ready(&debian_python("3.14"), "own_time.py", &[]);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p.pb.gz");
    let output = pyebpf_command().args(["record", "-p", &python.pid().to_string(), "-d", "8", "-F", "499", "-o"]).arg(&out).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(output.status.success(), "{stderr}");
    samples_written(&stderr);
    assert!(stderr.contains("top Python functions by own time"), "{stderr}");
    // `  61.2%   61.3%  sixty_percent (/path/own_time.py)`: the first row is the hottest.
    let rows: Vec<&str> = stderr.lines().skip_while(|l| !l.contains("own   total")).skip(1).take_while(|l| l.contains('%')).collect();
    assert!(!rows.is_empty() && rows.len() <= 5, "{stderr}");
    let share = |row: &str| -> f64 { row.split('%').next().unwrap().trim().parse().unwrap() };
    assert!(rows[0].contains("sixty_percent (") && rows[0].contains("own_time.py"), "hottest is not sixty_percent: {stderr}");
    assert!((share(rows[0]) - 60.0).abs() <= 3.0, "sixty_percent's share is {}: {stderr}", share(rows[0]));
    let thirty = rows.iter().find(|r| r.contains("thirty_percent (")).unwrap_or_else(|| panic!("{stderr}"));
    assert!((share(thirty) - 30.0).abs() <= 3.0, "thirty_percent's share is {}: {stderr}", share(thirty));
    assert!(stderr.contains("lost: ") && stderr.contains("Python stacks truncated: ") && stderr.contains("samples without frames: "), "{stderr}");
    assert!(stderr.contains(&format!("open it: go tool pprof -http=: {}", out.display())), "{stderr}");
    // stderr is a pipe here: no status line.
    assert!(!stderr.contains("recording ") && !stderr.contains('\r'), "status line on a pipe: {stderr}");
}

#[test]
fn progress_line_shows_on_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("p.folded");
    let _busy = Killed(Command::new("sh").args(["-c", "while :; do :; done"]).spawn().unwrap());
    // script(1) gives pyebpf a pseudo-terminal as stderr and copies what it wrote to stdout.
    let command = format!("{} record -a -d 2 -F 49 -o {}", pyebpf().display(), out.display());
    let output = Command::new("script").args(["-qec", &command, "/dev/null"]).output().unwrap();
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{text}");
    assert!(text.contains("recording ") && text.contains(" samples, "), "no status line on a terminal: {text}");
    assert!(text.contains("pyebpf: wrote "), "{text}");
}

#[test]
fn unknown_extension_is_a_one_line_error_before_sampling() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("profile.html");
    let started = Instant::now();
    let output: Output = pyebpf_command().args(["record", "-a", "-d", "10", "-o"]).arg(&out).output().unwrap();
    assert!(started.elapsed() < Duration::from_secs(2), "took {:?}: it sampled first", started.elapsed());
    assert_one_line_error(&output, "cannot tell the format of");
    assert!(String::from_utf8_lossy(&output.stderr).contains(".speedscope.json"));
    assert!(!out.exists());
    // With --format the name is the user's choice.
    let _busy = Killed(Command::new("sh").args(["-c", "while :; do :; done"]).spawn().unwrap());
    let output = pyebpf_command().args(["record", "-a", "-d", "1", "--format", "svg", "-o"]).arg(&out).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(fs::read_to_string(&out).unwrap().contains("<svg"));
}

#[test]
fn under_sudo_the_output_belongs_to_the_invoking_user() {
    let dir = tempfile::tempdir().unwrap();
    let _busy = Killed(Command::new("sh").args(["-c", "while :; do :; done"]).spawn().unwrap());
    for name in ["p.svg", "p.speedscope.json", "p.folded", "p.pb.gz"] {
        let out = dir.path().join(name);
        let output =
            pyebpf_command().args(["record", "-a", "-d", "1", "-F", "49", "-o"]).arg(&out).env("SUDO_UID", "4242").env("SUDO_GID", "4343").output().unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        let meta = fs::metadata(&out).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (4242, 4343), "{name}");
    }
    // Without sudo's variables the file is root's, as before.
    let out = dir.path().join("root.folded");
    let output = pyebpf_command().args(["record", "-a", "-d", "1", "-F", "49", "-o"]).arg(&out).env_remove("SUDO_UID").env_remove("SUDO_GID").output().unwrap();
    assert!(output.status.success());
    assert_eq!(fs::metadata(&out).unwrap().uid(), 0);
}

#[test]
fn comm_and_python_only_filters_keep_only_matching_processes() {
    let (python, _ready) = start_ready(&debian_python("3.14"), "sampling_proportions.py", &[]);
    let busy = Killed(Command::new("sh").args(["-c", "while :; do :; done"]).spawn().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let roots = |extra: &[&str]| -> Vec<String> {
        let out = dir.path().join("f.folded");
        let output = pyebpf_command().args(["record", "-a", "-d", "2", "-F", "99", "-o"]).arg(&out).args(extra).output().unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        let text = fs::read_to_string(&out).unwrap();
        let mut roots: Vec<String> = text.lines().map(|line| line.split(';').next().unwrap().to_string()).collect();
        roots.dedup();
        roots
    };
    let python_root = format!("python3.14 ({})", python.pid());
    let busy_root = format!("sh ({})", busy.pid());
    let everything = roots(&[]);
    assert!(everything.contains(&python_root) && everything.contains(&busy_root), "{everything:?}");

    let comm = roots(&["--comm", "^sh$"]);
    assert!(comm.contains(&busy_root), "{comm:?}");
    assert!(comm.iter().all(|root| root.starts_with("sh (")), "--comm kept others: {comm:?}");

    let python_only = roots(&["--python-only"]);
    assert!(python_only.contains(&python_root), "{python_only:?}");
    assert!(!python_only.contains(&busy_root), "--python-only kept sh: {python_only:?}");

    let output = pyebpf_command().args(["record", "-a", "--comm", "(unclosed", "-o"]).arg(dir.path().join("x.folded")).output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("not a regular expression"), "{stderr}");
    assert!(!stderr.contains("panicked"));
}
