//! The live progress bar: requests done, leaks, wrong statuses. Drawn on stderr only when it
//! is a terminal (indicatif hides it otherwise), so logs and tests stay clean.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

#[derive(Clone)]
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    pub fn new(visible: bool) -> Self {
        let bar = ProgressBar::with_draw_target(
            Some(0),
            if visible {
                ProgressDrawTarget::stderr()
            } else {
                ProgressDrawTarget::hidden()
            },
        );
        if let Ok(style) = ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} requests · {msg}",
        ) {
            bar.set_style(style);
        }
        bar.set_message("leaks 0 · wrong statuses 0");
        Self { bar }
    }

    pub fn add_len(&self, n: usize) {
        self.bar.inc_length(n as u64);
    }

    pub fn tick(&self, leaks: usize, wrong_statuses: usize) {
        self.bar.inc(1);
        self.bar
            .set_message(format!("leaks {leaks} · wrong statuses {wrong_statuses}"));
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
