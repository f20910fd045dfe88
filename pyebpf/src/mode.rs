//! What a profile measures: the one choice (`--mode`, `top`'s `m` key) that decides which hooks the
//! sampler attaches, how samples are weighted and how profiles and summaries are titled.

use clap::ValueEnum;

/// What a profile measures (`--mode`).
#[derive(ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Time on CPU: samples of running threads
    #[default]
    Cpu,
    /// Wall-clock time: samples on CPU and every interval off CPU (sleeping, waiting on a lock,
    /// I/O or the GIL), so each thread's shares add up to its time
    Wall,
    /// Time off CPU only: each interval a thread waited, with the stack it waited in
    OffCpu,
    /// Time holding the GIL: samples of Python threads that held it (CPython 3.8+)
    Gil,
}

impl Mode {
    /// Whether the mode counts off-CPU intervals (the scheduler hooks are attached).
    pub fn counts_waits(self) -> bool {
        matches!(self, Mode::Wall | Mode::OffCpu)
    }

    /// What a profile of this mode measures, for titles and summaries.
    pub fn measures(self) -> &'static str {
        match self {
            Mode::Cpu => "CPU time",
            Mode::Wall => "wall-clock time",
            Mode::OffCpu => "off-CPU time",
            Mode::Gil => "time holding the GIL",
        }
    }
}
