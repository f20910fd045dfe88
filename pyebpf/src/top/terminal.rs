//! The terminal `top` draws on: checked before anything is loaded, taken over (raw mode, the
//! alternate screen) while the view runs, and given back on every way out — a return, an error,
//! or a panic (ratatui's panic hook restores it before the message is printed).

use std::io::IsTerminal;
use std::time::Duration;

use ratatui::crossterm::event::{self, Event};
use ratatui::DefaultTerminal;
use tokio::sync::mpsc;

use super::View;

#[derive(Debug, thiserror::Error)]
pub enum TerminalError {
    #[error("pyebpf top draws a live view: standard output must be a terminal (use `pyebpf record` to write a profile)")]
    NotATerminal,
    #[error("the terminal is {width}x{height}; pyebpf top needs at least {min_width}x{min_height}")]
    TooSmall { width: u16, height: u16, min_width: u16, min_height: u16 },
    #[error("cannot read the terminal's size: {0}")]
    Size(std::io::Error),
    #[error("cannot take over the terminal: {0}")]
    Open(std::io::Error),
    #[error("cannot draw on the terminal: {0}")]
    Draw(std::io::Error),
}

/// Standard output is a terminal of at least `min_width` x `min_height`.
pub fn check_stdout(min_width: u16, min_height: u16) -> Result<(), TerminalError> {
    if !std::io::stdout().is_terminal() {
        return Err(TerminalError::NotATerminal);
    }
    let (width, height) = stdout_size()?;
    if width < min_width || height < min_height {
        return Err(TerminalError::TooSmall { width, height, min_width, min_height });
    }
    Ok(())
}

/// The size of the terminal on standard output (not on /dev/tty, which may be another one).
fn stdout_size() -> Result<(u16, u16), TerminalError> {
    let mut size = libc::winsize { ws_row: 0, ws_col: 0, ws_xpixel: 0, ws_ypixel: 0 };
    // SAFETY: TIOCGWINSZ fills the winsize it is given.
    if unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut size) } != 0 {
        return Err(TerminalError::Size(std::io::Error::last_os_error()));
    }
    Ok((size.ws_col, size.ws_row))
}

/// The terminal while the view owns it; dropping it gives the terminal back.
pub struct Screen {
    terminal: DefaultTerminal,
}

impl Screen {
    pub fn open() -> Result<Screen, TerminalError> {
        match ratatui::try_init() {
            Ok(terminal) => Ok(Screen { terminal }),
            Err(err) => {
                // Raw mode may be on already when the alternate screen failed.
                ratatui::restore();
                Err(TerminalError::Open(err))
            }
        }
    }

    pub fn draw(&mut self, view: &View) -> Result<(), TerminalError> {
        self.terminal.draw(|frame| super::render::draw(frame, view)).map(|_| ()).map_err(TerminalError::Draw)
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        ratatui::restore();
    }
}

/// Terminal events, read on a thread of their own (crossterm's reads block). The thread ends
/// when the receiver is dropped.
pub fn read_keys() -> mpsc::Receiver<std::io::Result<Event>> {
    let (sender, receiver) = mpsc::channel(64);
    std::thread::spawn(move || {
        while !sender.is_closed() {
            let event = match event::poll(Duration::from_millis(100)) {
                Ok(false) => continue,
                Ok(true) => event::read(),
                Err(err) => Err(err),
            };
            let failed = event.is_err();
            if sender.blocking_send(event).is_err() || failed {
                return;
            }
        }
    });
    receiver
}
