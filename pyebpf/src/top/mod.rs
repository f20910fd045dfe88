//! `pyebpf top`: a live view of the hottest functions on the host, refreshed every second, fed by
//! the same sampler and session as `record`.

mod render;
mod tally;
mod terminal;

use std::time::Duration;

use anyhow::{Context, Result};
use ratatui::crossterm::event::{Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};

use crate::bpf::{check_privileges, default_ring_buffer_kb, Sampler, SamplerOptions, UnwindMode};
use crate::cli::{TopArgs, DEFAULT_MAX_PYTHON_FRAMES};
use crate::mode::Mode;
use crate::process::{self, Watched};
use crate::python::SamplingOptions;
use crate::reader::RecordBatch;
use crate::session::{add_samples, Session, SessionOptions};
use crate::stats::Stats;
use crate::stop_signals::StopSignals;
use tally::{FrameView, Snapshot, SortBy, Tally};
use terminal::Screen;

/// How often the view takes a new window of samples.
const REFRESH: Duration = Duration::from_secs(1);
/// Every this many windows the frame table starts again with the frames still in use, so one left
/// running on a host where processes come and go does not keep the frames of every one of them.
const RENEW_FRAMES_WINDOWS: u64 = 60;

/// What the screen shows.
pub struct View {
    sort: SortBy,
    frames: FrameView,
    paused: bool,
    /// The last window's rows while running; the window shown when paused.
    shown: Snapshot,
    /// Windows ended so far.
    windows: u64,
    lost: u64,
    frequency_hz: u64,
    /// Which processes are sampled, in words.
    targets: String,
    /// What the rows measure.
    mode: Mode,
}

/// What a key asks for.
#[derive(Debug, PartialEq, Eq)]
enum Action {
    Redraw,
    Quit,
    Nothing,
    /// Sample in the next mode (`m`): the sampler starts again with it.
    NextMode,
}

impl View {
    /// The view as top starts: sorted by own time, merged frames, nothing shown yet.
    fn new(frequency_hz: u64, targets: String, mode: Mode) -> View {
        View { sort: SortBy::Own, frames: FrameView::Merged, paused: false, shown: Snapshot::default(), windows: 0, lost: 0, frequency_hz, targets, mode }
    }

    fn key(&mut self, key: KeyEvent) -> Action {
        if key.kind == KeyEventKind::Release {
            return Action::Nothing;
        }
        match key.code {
            // Raw mode delivers Ctrl-C as a key, not as SIGINT.
            KeyCode::Char('c') if key.modifiers.contains(KeyModifiers::CONTROL) => return Action::Quit,
            KeyCode::Char('q') | KeyCode::Esc => return Action::Quit,
            KeyCode::Char('o') => self.sort = SortBy::Own,
            KeyCode::Char('t') => self.sort = SortBy::Total,
            KeyCode::Char('p') => self.frames = self.frames.toggled(),
            KeyCode::Char(' ') => self.paused = !self.paused,
            KeyCode::Char('m') => {
                self.mode = next_mode(self.mode);
                self.shown = Snapshot::default();
                self.windows = 0;
                return Action::NextMode;
            }
            _ => return Action::Nothing,
        }
        self.shown.sort(self.sort);
        Action::Redraw
    }

    /// A window ended: shown unless paused (sampling goes on either way).
    fn window_ended(&mut self, mut snapshot: Snapshot, lost: u64) -> Action {
        self.windows += 1;
        if self.paused {
            return Action::Nothing;
        }
        snapshot.sort(self.sort);
        self.shown = snapshot;
        self.lost = lost;
        Action::Redraw
    }
}

pub fn run(args: TopArgs) -> Result<()> {
    // Before anything is loaded: top only makes sense on a terminal big enough for it.
    terminal::check_stdout(render::MIN_WIDTH, render::MIN_HEIGHT)?;
    check_privileges()?;
    let _watched = Watched::open(&args.pid)?;
    process::raise_open_file_limit();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().context("start the async runtime")?;
    runtime.block_on(top(&args))
}

/// The mode `m` switches to.
fn next_mode(mode: Mode) -> Mode {
    match mode {
        Mode::Cpu => Mode::Wall,
        Mode::Wall => Mode::OffCpu,
        Mode::OffCpu => Mode::Gil,
        Mode::Gil => Mode::Cpu,
    }
}

/// What the sampler loads for `mode`.
fn sampler_options(args: &TopArgs, mode: Mode) -> SamplerOptions {
    SamplerOptions {
        frequency_hz: args.frequency,
        kernel_stacks: false,
        targets: (!args.pid.is_empty()).then(|| args.pid.clone()),
        follow_forks: false,
        ring_buffer_kb: default_ring_buffer_kb(args.frequency),
        program_stats: false,
        unwind: UnwindMode::Auto,
        gil: mode == Mode::Gil,
        tasks: args.mode.async_aware,
        waiting_tasks: mode.counts_waits() && args.mode.async_aware,
        off_cpu_min: mode.counts_waits().then(|| Duration::from_micros(args.mode.off_cpu_min_us)),
    }
}

/// A tally whose samples stand for one period and whose rows measure `mode` (the next windows
/// keep both).
fn tally_for(args: &TopArgs, mode: Mode) -> Tally {
    let mut tally = Tally::default();
    tally.window_mut().frequency_hz = args.frequency;
    tally.window_mut().mode = mode;
    tally
}

/// The session `top` runs: every native frame, unwound as `--unwind auto` does.
fn session(args: &TopArgs) -> Session {
    let sampling = SamplingOptions { marker: true, read_only: args.read_only, max_frames: DEFAULT_MAX_PYTHON_FRAMES, async_aware: args.mode.async_aware };
    Session::new(SessionOptions {
        sampling,
        no_native: false,
        native_lines: false,
        filter: args.filter.sample_filter(),
        unwind: UnwindMode::Auto,
        mode: args.mode.mode,
        kernel: false,
        details: None,
        timed: false,
    })
}

async fn top(args: &TopArgs) -> Result<()> {
    let mut stops = StopSignals::new().context("read stop signals")?;
    let mode = args.mode.mode;
    let mut session = session(args);
    let mut stats = Stats::default();
    let mut sampler = session.start_sampler(&sampler_options(args, mode), &mut stats)?;
    session.start_recording();
    // The screen is taken only once sampling runs, so a failure to load says so on the normal screen.
    let mut screen = Screen::open()?;
    let mut keys = terminal::read_keys();
    let mut view = View::new(args.frequency, describe_targets(args), mode);
    screen.draw(&view)?;
    let mut tally = tally_for(args, mode);
    let mut refresh = tokio::time::interval_at(tokio::time::Instant::now() + REFRESH, REFRESH);
    let mut upkeep_at = tokio::time::Instant::now() + session.upkeep_interval();
    let mut batch = RecordBatch::default();
    loop {
        let action = tokio::select! {
            read = sampler.read_samples(&mut batch) => {
                read?;
                add_samples(&mut batch, &mut session, &mut sampler, tally.window_mut(), &mut stats);
                Action::Nothing
            }
            _ = refresh.tick() => {
                // The window ends with what was sampled up to now (the kernel hands records over
                // only every so often).
                sampler.drain_samples(&mut batch).await?;
                add_samples(&mut batch, &mut session, &mut sampler, tally.window_mut(), &mut stats);
                let snapshot = tally.end_window();
                if tally.windows().is_multiple_of(RENEW_FRAMES_WINDOWS) {
                    tally.window_mut().renew_frames(|carry| session.carry_frames(carry));
                }
                view.window_ended(snapshot, sampler.lost_samples())
            }
            _ = tokio::time::sleep_until(upkeep_at) => {
                upkeep_at = upkeep(&mut session, &mut sampler);
                Action::Nothing
            }
            event = keys.recv() => match event {
                Some(Ok(Event::Key(key))) => view.key(key),
                Some(Ok(Event::Resize(..))) => Action::Redraw,
                Some(Ok(_)) => Action::Nothing,
                Some(Err(err)) => return Err(err).context("cannot read the keyboard"),
                None => Action::Quit,
            },
            _ = stops.next() => Action::Quit,
        };
        match action {
            Action::Quit => return Ok(()),
            Action::Redraw => screen.draw(&view)?,
            Action::NextMode => {
                // The programs of the old mode go first (dropping the sampler detaches them).
                drop(sampler);
                session.set_mode(view.mode);
                sampler = session.start_sampler(&sampler_options(args, view.mode), &mut stats)?;
                session.start_recording();
                tally = tally_for(args, view.mode);
                batch = RecordBatch::default();
                screen.draw(&view)?;
            }
            Action::Nothing => {}
        }
    }
}

/// The session's slow upkeep; returns when it is due next.
fn upkeep(session: &mut Session, sampler: &mut Sampler) -> tokio::time::Instant {
    let lost_events = sampler.lost_events();
    session.upkeep(sampler, lost_events);
    tokio::time::Instant::now() + session.upkeep_interval()
}

fn describe_targets(args: &TopArgs) -> String {
    let mut text = match args.pid.as_slice() {
        [] => "all processes".to_string(),
        pids => format!("PID {}", pids.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")),
    };
    if let Some(comm) = &args.filter.comm {
        text.push_str(&format!(", comm ~ {comm}"));
    }
    if args.filter.python_only {
        text.push_str(", Python processes");
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view() -> View {
        View::new(99, String::new(), Mode::Cpu)
    }

    #[test]
    fn m_cycles_through_the_modes() {
        let mut view = view();
        let mut seen = Vec::new();
        for _ in 0..4 {
            assert_eq!(press(&mut view, KeyCode::Char('m'), KeyModifiers::NONE), Action::NextMode);
            seen.push(view.mode);
        }
        assert_eq!(seen, [Mode::Wall, Mode::OffCpu, Mode::Gil, Mode::Cpu]);
    }

    fn press(view: &mut View, code: KeyCode, modifiers: KeyModifiers) -> Action {
        view.key(KeyEvent::new(code, modifiers))
    }

    #[test]
    fn keys_sort_switch_frames_pause_and_quit() {
        let mut view = view();
        assert_eq!(press(&mut view, KeyCode::Char('t'), KeyModifiers::NONE), Action::Redraw);
        assert_eq!(view.sort, SortBy::Total);
        press(&mut view, KeyCode::Char('o'), KeyModifiers::NONE);
        assert_eq!(view.sort, SortBy::Own);
        press(&mut view, KeyCode::Char('p'), KeyModifiers::NONE);
        assert_eq!(view.frames, FrameView::PythonOnly);
        press(&mut view, KeyCode::Char(' '), KeyModifiers::NONE);
        assert!(view.paused);
        assert_eq!(press(&mut view, KeyCode::Char('x'), KeyModifiers::NONE), Action::Nothing);
        assert_eq!(press(&mut view, KeyCode::Char('c'), KeyModifiers::CONTROL), Action::Quit);
        assert_eq!(press(&mut view, KeyCode::Char('q'), KeyModifiers::NONE), Action::Quit);
    }

    #[test]
    fn a_paused_view_keeps_its_window() {
        let mut view = view();
        let mut tally = Tally::default();
        view.paused = true;
        tally.window_mut().add(crate::output::test_profile::key(1, 1, "a", vec![]), 1);
        assert_eq!(view.window_ended(tally.end_window(), 0), Action::Nothing);
        assert_eq!((view.shown.samples, view.windows), (0, 1));
        view.paused = false;
        tally.window_mut().add(crate::output::test_profile::key(1, 1, "a", vec![]), 1);
        assert_eq!(view.window_ended(tally.end_window(), 3), Action::Redraw);
        assert_eq!((view.shown.samples, view.lost), (1, 3));
    }
}
