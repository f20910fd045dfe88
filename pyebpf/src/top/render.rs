//! Drawing `top`'s screen from its state: a status line, the table of functions, the keys.

use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Style, Stylize};
use ratatui::text::Line;
use ratatui::widgets::{Cell, Paragraph, Row as TableRow, Table};
use ratatui::Frame;

use super::tally::{FrameView, Row, SortBy};
use super::View;

/// The smallest terminal the view is drawn in.
pub const MIN_WIDTH: u16 = 60;
pub const MIN_HEIGHT: u16 = 10;

const HEADERS: [&str; 7] = ["OWN%", "TOTAL%", "OWN s", "TOTAL s", "FUNCTION", "FILE:LINE / MODULE", "PROCESS"];

pub fn draw(frame: &mut Frame, view: &View) {
    let area = frame.area();
    if area.width < MIN_WIDTH || area.height < MIN_HEIGHT {
        frame.render_widget(Paragraph::new(format!("terminal too small: {}x{}, top needs {MIN_WIDTH}x{MIN_HEIGHT}", area.width, area.height)), area);
        return;
    }
    let [status, table, keys] = Layout::vertical([Constraint::Length(1), Constraint::Fill(1), Constraint::Length(1)]).areas(area);
    frame.render_widget(Paragraph::new(status_line(view)).style(Style::new().reversed()), status);
    draw_table(frame, table, view);
    frame.render_widget(Paragraph::new(keys_line(view)).style(Style::new().dark_gray()), keys);
}

fn status_line(view: &View) -> String {
    let mut line = format!(" pyebpf top  {}", view.targets);
    match view.windows {
        0 => line.push_str("  collecting the first second..."),
        _ => line.push_str(&format!("  {} samples in the last second at {} Hz, {} lost", view.shown.samples, view.frequency_hz, view.lost)),
    }
    line.push_str(&format!("  [{}]", view.mode.measures()));
    if view.paused {
        line.push_str("  [PAUSED]");
    }
    line
}

fn keys_line(view: &View) -> Line<'static> {
    let sort = match view.sort {
        SortBy::Own => "own",
        SortBy::Total => "total",
    };
    let frames = match view.frames {
        FrameView::Merged => "merged native+Python",
        FrameView::PythonOnly => "Python only",
    };
    let pause = if view.paused { "resume" } else { "pause" };
    Line::from(format!(" sorted by {sort} (o/t)  frames: {frames} (p)  mode (m)  space: {pause}  q: quit"))
}

fn draw_table(frame: &mut Frame, area: Rect, view: &View) {
    let widths = [
        Constraint::Length(6),
        Constraint::Length(6),
        Constraint::Length(8),
        Constraint::Length(8),
        Constraint::Fill(3),
        Constraint::Fill(2),
        Constraint::Length(18),
    ];
    let columns = Layout::horizontal(widths).spacing(1).split(area);
    let location_width = columns[5].width as usize;
    let header = TableRow::new(HEADERS.iter().enumerate().map(|(i, title)| {
        let sorted = (i == 0 && view.sort == SortBy::Own) || (i == 1 && view.sort == SortBy::Total);
        let cell = Cell::from(*title);
        if sorted {
            cell.underlined()
        } else {
            cell
        }
    }))
    .bold();
    let rows = view.shown.rows(view.frames).iter().take(area.height.saturating_sub(1) as usize).map(|row| table_row(row, view.shown.ns, location_width));
    frame.render_widget(Table::new(rows, widths).header(header).column_spacing(1), area);
}

fn table_row(row: &Row, window_ns: u64, location_width: usize) -> TableRow<'static> {
    let share = |ns: u64| if window_ns == 0 { 0.0 } else { 100.0 * ns as f64 / window_ns as f64 };
    let seconds = |ns: u64| ns as f64 / 1e9;
    let function = &row.function;
    let name = Cell::from(function.name.to_string()).style(if function.python { Style::new().fg(Color::Cyan) } else { Style::new() });
    TableRow::new([
        Cell::from(format!("{:>5.1}", share(row.own))),
        Cell::from(format!("{:>5.1}", share(row.total))),
        Cell::from(format!("{:>7.2}", seconds(row.own_so_far))),
        Cell::from(format!("{:>7.2}", seconds(row.total_so_far))),
        name,
        Cell::from(keep_end(&function.location, location_width)),
        Cell::from(format!("{} {}", function.comm, function.pid)),
    ])
}

/// The end of `text` in at most `width` characters, where a path's file name and line are.
fn keep_end(text: &str, width: usize) -> String {
    let chars = text.chars().count();
    if chars <= width || width == 0 {
        return text.to_string();
    }
    let kept: String = text.chars().skip(chars - (width - 1)).collect();
    format!("…{kept}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_locations_keep_their_file_name_and_line() {
        assert_eq!(keep_end("/srv/app/models/user.py:12", 12), "…/user.py:12");
        assert_eq!(keep_end("short.py:1", 12), "short.py:1");
    }
}
