//! How kruskal speaks on the terminal: warnings and notes on standard
//! error, spinners, and numbers and shapes as text. The program, the
//! loaders of [`crate::input`] and the measurements of [`crate::measure`]
//! share them, so what they print looks the same.

use indicatif::ProgressBar;

/// `1,234,567`.
pub use kruskal_cpd::memory::{count_of, dims_text, thousands};

/// An option as the command line spells it: its flag, then the value
/// given (`--gpus 3`). The library names options neutrally
/// ([`kruskal_cpd::OptionName`]); the program writes them so.
pub fn flag(option: kruskal_cpd::OptionName, value: Option<&str>) -> String {
    let name = option.name().replace('_', "-");
    match value {
        Some(v) => format!("--{name} {v}"),
        None => format!("--{name}"),
    }
}

/// Prints a warning: something the user should check, that did not stop
/// the work.
pub fn warn(message: &str) {
    eprintln!("kruskal: warning: {message}");
}

/// Prints a note: what the program did that the user did not ask for.
pub fn note(message: &str) {
    eprintln!("kruskal: note: {message}");
}

/// A spinner on stderr when it is a terminal (hidden otherwise).
pub fn spinner(message: &str) -> ProgressBar {
    let bar = ProgressBar::new_spinner();
    bar.set_message(message.to_string());
    bar.enable_steady_tick(std::time::Duration::from_millis(120));
    bar
}
