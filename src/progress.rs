//! Progress of a long job: a live bar with ETA on a terminal, plain lines otherwise.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;

/// Training progress over iterations.
pub struct Progress {
    bar: Option<ProgressBar>,
}

impl Progress {
    /// A bar from iteration `start` to `total` when stderr is a terminal.
    pub fn new(start: u64, total: u64) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template(
                    "{bar:30.cyan/blue} {pos}/{len} iters  {msg}  [{elapsed_precise} < {eta_precise}]",
                )
                .expect("a valid progress template"),
            );
            bar.set_position(start);
            bar
        });
        Progress { bar }
    }

    /// A bar over `total` items of a job (`what`: "questions") when stderr is a
    /// terminal; nothing otherwise.
    pub fn counting(total: u64, what: &str) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            let template = format!("{{bar:30.cyan/blue}} {{pos}}/{{len}} {what}  [{{elapsed_precise}} < {{eta_precise}}]");
            bar.set_style(ProgressStyle::with_template(&template).expect("a valid progress template"));
            bar
        });
        Progress { bar }
    }

    /// Marks `done` items done.
    pub fn set(&mut self, done: u64) {
        if let Some(bar) = &self.bar {
            bar.set_position(done);
        }
    }

    /// Marks iteration `iter` done with its loss.
    pub fn step(&mut self, iter: u64, loss: f32) {
        if let Some(bar) = &self.bar {
            bar.set_position(iter + 1);
            bar.set_message(format!("loss {loss:.4}"));
        }
    }

    /// A periodic log line: above the bar on a terminal, on stdout otherwise.
    pub fn log(&mut self, line: &str) {
        self.println(line);
    }

    /// A line that is always shown (evaluations, checkpoints, warnings).
    pub fn println(&mut self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => crate::outln!("{line}"),
        }
    }

    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}
