//! An interactive flame graph (inferno's SVG, with its search and zoom), drawn from the same stacks as
//! the collapsed output. Frames are coloured by kind: Python blue, native red, kernel orange, and the
//! process, thread and `[truncated]` frames grey; the shade within a kind follows the name, so one
//! function has one colour throughout.

use std::io::{self, Write};

use inferno::flamegraph::color::{Color, PaletteMap};
use inferno::flamegraph::{self, Options};

use crate::stack::{Frame, Profile};

use super::collapsed::{merged_lines, sanitize};
use super::{frame_name, process_frame, state_frame, text_unit, thread_frame, Rendering, TRUNCATED_FRAME};

pub(super) fn write(profile: &Profile, rendering: &Rendering, out: &mut dyn Write) -> io::Result<()> {
    let lines = merged_lines(profile, rendering.threads);
    let rendered: Vec<String> = lines.iter().map(|(stack, count)| format!("{stack} {count}")).collect();
    let mut palette = palette(profile, rendering.threads);
    let mut options = Options::default();
    options.title = rendering.title.clone();
    options.subtitle = Some(subtitle(profile));
    options.count_name = text_unit(profile).to_string();
    options.palette_map = Some(&mut palette);
    options.deterministic = true;
    flamegraph::from_lines(&mut options, rendered.iter().map(String::as_str), out)
}

fn subtitle(profile: &Profile) -> String {
    format!(
        "{}: {:.1} s, {} samples at {} Hz{}. Python frames blue, native red, kernel orange",
        profile.mode.measures(),
        profile.duration_ns as f64 / 1e9,
        profile.total_samples(),
        profile.frequency_hz,
        if profile.mode.counts_waits() { " and off-CPU intervals, widths in microseconds" } else { "" }
    )
}

/// What a frame of the graph is, for its colour.
#[derive(Clone, Copy)]
enum Kind {
    Python,
    Native,
    Kernel,
    /// Process, thread and `[truncated]` frames: where stacks come from, not code.
    Grouping,
}

/// Every frame name of the graph with its colour, as the collapsed lines spell it.
fn palette(profile: &Profile, threads: bool) -> PaletteMap {
    let mut palette = PaletteMap::default();
    let mut add = |name: String, kind: Kind| {
        let color = color(kind, &name);
        palette.insert(name, color);
    };
    add(TRUNCATED_FRAME.to_string(), Kind::Grouping);
    for (key, _) in profile.stacks() {
        add(sanitize(&process_frame(&key)), Kind::Grouping);
        if let Some(state) = state_frame(key.state) {
            add(state, Kind::Grouping);
        }
        if threads {
            add(thread_frame(key.tid), Kind::Grouping);
        }
        for frame in key.frames.iter() {
            let kind = match frame {
                Frame::Python(_) | Frame::Task(_) => Kind::Python,
                Frame::Native(_) => Kind::Native,
                Frame::Kernel(_) => Kind::Kernel,
            };
            add(sanitize(&frame_name(frame)), kind);
        }
    }
    palette
}

fn color(kind: Kind, name: &str) -> Color {
    let shade = shade(name);
    let channel = |base: u8, range: u8| base + (f32::from(range) * shade) as u8;
    match kind {
        Kind::Python => Color { r: channel(50, 50), g: channel(140, 60), b: channel(215, 40) },
        Kind::Native => Color { r: channel(205, 50), g: channel(50, 60), b: channel(40, 40) },
        Kind::Kernel => Color { r: channel(225, 30), g: channel(145, 50), b: channel(0, 40) },
        Kind::Grouping => {
            let grey = channel(170, 40);
            Color { r: grey, g: grey, b: grey }
        }
    }
}

/// A value in [0, 1) fixed by the name (FNV-1a), so colours are the same in every run.
fn shade(name: &str) -> f32 {
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3));
    (hash >> 40) as f32 / (1u64 << 24) as f32
}

#[cfg(test)]
mod tests {
    use super::super::test_profile::sample_profile;
    use super::*;

    fn render(rendering: &Rendering) -> String {
        let mut out = Vec::new();
        write(&sample_profile(), rendering, &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    /// The `fill` of the rectangle whose title starts with `name`.
    fn fill_of(svg: &str, name: &str) -> String {
        let at = svg.find(&format!("<title>{name}")).unwrap_or_else(|| panic!("no frame {name}"));
        let rest = &svg[at..];
        let fill = rest.find("fill=\"").unwrap() + 6;
        rest[fill..fill + rest[fill..].find('"').unwrap()].to_string()
    }

    #[test]
    fn title_subtitle_and_every_frame_are_in_the_svg() {
        let svg = render(&Rendering { threads: false, title: "pyebpf record -a <all>".into() });
        assert!(svg.starts_with("<?xml"), "{}", &svg[..100]);
        assert!(svg.contains("pyebpf record -a &lt;all&gt;"), "title missing or not escaped");
        assert!(svg.contains("2.0 s, 15 samples at 100 Hz"));
        for name in ["app (100)", "Worker.compute (/srv/work.py:14)", "main (/srv/work.py:33)", "do_syscall_64", "leaf_fn"] {
            assert!(svg.contains(name), "{name} missing");
        }
    }

    #[test]
    fn python_native_and_kernel_frames_differ_in_colour() {
        let svg = render(&Rendering::default());
        let python = fill_of(&svg, "Worker.compute");
        let native = fill_of(&svg, "leaf_fn");
        let kernel = fill_of(&svg, "do_syscall_64");
        let blue = |fill: &str| {
            let rgb: Vec<u8> = fill.trim_start_matches("rgb(").trim_end_matches(')').split(',').map(|c| c.trim().parse().unwrap()).collect();
            rgb[2] > rgb[0]
        };
        assert!(blue(&python), "{python}");
        assert!(!blue(&native) && !blue(&kernel), "{native} {kernel}");
        assert_ne!(native, kernel);
    }

    #[test]
    fn threads_are_frames_when_asked() {
        assert!(render(&Rendering { threads: true, title: String::new() }).contains("thread 101"));
        assert!(!render(&Rendering::default()).contains("thread 101"));
    }
}
