//! The progress bar of `run` and `bench`: loading, prefill, decode, and which warm-up or
//! timed generation is running. Drawn only for a person watching a terminal: a pipe, a log
//! file or `--json` gets no bar (no carriage returns, no escape codes).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tpc::runtime::generate::{Progress, Stage};

/// Whether long work draws progress: only on a terminal, and never under `--json`.
pub fn shows_progress(stderr_is_terminal: bool, json: bool) -> bool {
    stderr_is_terminal && !json
}

/// A bar of `tokens` steps on stderr when [`shows_progress`] says so, a hidden one
/// otherwise; it says that `ranks` ranks are loading until the runtime reports.
pub fn bar(tokens: usize, ranks: u64, json: bool) -> ProgressBar {
    let target = if shows_progress(std::io::stderr().is_terminal(), json) {
        ProgressDrawTarget::stderr()
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(Some(tokens as u64), target);
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len} tokens")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(match ranks {
        1 => "loading 1 rank".to_string(),
        n => format!("loading {n} ranks"),
    });
    if !bar.is_hidden() {
        bar.enable_steady_tick(std::time::Duration::from_millis(100));
    }
    bar
}

/// Which of `warmup` untimed and `repeat` timed generations generation `index` (from 0) is:
/// "warm-up 1/2", "run 3/5", or nothing when there is only one.
pub fn generation_label(index: usize, warmup: usize, repeat: usize) -> String {
    let repeat = repeat.max(1);
    if warmup == 0 && repeat == 1 {
        String::new()
    } else if index < warmup {
        format!("warm-up {}/{warmup} ", index + 1)
    } else {
        format!("run {}/{repeat} ", (index - warmup + 1).min(repeat))
    }
}

/// The runtime's stage reports as messages on `bar`: every generation reports one
/// `Prefilled`, so their count says which generation is decoding.
pub fn reporter(bar: &ProgressBar, warmup: usize, repeat: usize) -> Progress {
    let bar = bar.clone();
    let prefilled = AtomicUsize::new(0);
    Arc::new(move |stage| match stage {
        Stage::Loaded => bar.set_message(format!("{}prefill", generation_label(0, warmup, repeat))),
        Stage::Prefilled => {
            let index = prefilled.fetch_add(1, Ordering::Relaxed);
            bar.set_position(0);
            bar.set_message(format!("{}decode", generation_label(index, warmup, repeat)));
        }
        Stage::Token(n) => bar.set_position(n as u64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_only_on_a_terminal_without_json() {
        assert!(shows_progress(true, false));
        assert!(!shows_progress(true, true));
        assert!(!shows_progress(false, false));
        assert!(!shows_progress(false, true));
    }

    #[test]
    fn the_label_names_the_warm_up_or_timed_generation() {
        assert_eq!(generation_label(0, 0, 1), "");
        assert_eq!(generation_label(0, 2, 3), "warm-up 1/2 ");
        assert_eq!(generation_label(1, 2, 3), "warm-up 2/2 ");
        assert_eq!(generation_label(2, 2, 3), "run 1/3 ");
        assert_eq!(generation_label(4, 2, 3), "run 3/3 ");
        assert_eq!(generation_label(0, 0, 2), "run 1/2 ");
    }

    #[test]
    fn the_reporter_counts_generations_by_their_prefills() {
        let bar = ProgressBar::hidden();
        let report = reporter(&bar, 1, 2);
        report(Stage::Loaded);
        assert_eq!(bar.message(), "warm-up 1/1 prefill");
        report(Stage::Prefilled);
        report(Stage::Token(3));
        assert_eq!(
            (bar.message(), bar.position()),
            ("warm-up 1/1 decode".into(), 3)
        );
        report(Stage::Prefilled);
        assert_eq!(
            (bar.message(), bar.position()),
            ("run 1/2 decode".into(), 0)
        );
        report(Stage::Prefilled);
        assert_eq!(bar.message(), "run 2/2 decode");
    }
}
