//! The library's messages in Python's words.
//!
//! A library message that names an option names it neutrally
//! ([`kruskal_formats::OptionName`]); [`keyword`] writes it as the keyword
//! of `kruskal.cp_als`, `kruskal.read` or `kruskal.mttkrp` (`rank`,
//! `kernel="coo"`, `iters=0`, `pattern=True`), in errors, warnings and
//! notes alike. What remains rewritten as text is modes: the library counts
//! them from 1, as FROSTT files and the model's `mode-<n>.npy` names do,
//! where a Python user counts from 0, as `mttkrp(X, factors, mode)` and
//! `factors[n]` do. Every library message that reaches Python as text (an
//! exception, a reader's warning, a note in `info["notes"]`) passes
//! through [`python_words`] for that (the decomposition's warnings are
//! data, written with modes from 0); the command line's own messages stay
//! as they are.

use kruskal_formats::OptionName;

/// An option as a keyword of the Python API (the neutral name), with the
/// value given: a number as it is (`iters=0`), a word as a string
/// (`kernel="coo"`), a switch as `True` (`pattern=True`). Launch
/// parameters the tuning model chooses (`threadlen`, FLYCOO's `kappa`,
/// `block_bits`) are no keywords of the Python API; they keep the neutral
/// name and value (`threadlen 8`), as does `no_model`.
pub fn keyword(option: OptionName, value: Option<&str>) -> String {
    match (option, value) {
        (
            OptionName::Threadlen | OptionName::Kappa | OptionName::BlockBits | OptionName::NoModel,
            _,
        ) => kruskal_formats::option::neutral(option, value),
        (OptionName::Pattern | OptionName::ZeroBased, None) => format!("{option}=True"),
        (_, Some(v)) if is_number(v) => format!("{option}={v}"),
        (_, Some(v)) => format!("{option}=\"{v}\""),
        (_, None) => option.name().to_string(),
    }
}

fn is_number(word: &str) -> bool {
    !word.is_empty() && word.parse::<f64>().is_ok()
}

/// Phrases of the library's messages that count modes from 1: the text
/// before the number and after it. The number becomes one less.
const ONE_BASED_MODES: &[(&str, &str)] = &[
    ("the mode-", " factor holds"),
    ("factor of mode ", " "),
    ("mode ", " has dimension"),
    ("mode ", " rows read"),
    ("mode ", " all rows"),
];

/// `text` (a library message) with every mode counted from 0.
pub fn python_words(text: &str) -> String {
    renumber_modes(text)
}

fn renumber_modes(text: &str) -> String {
    let mut text = text.to_string();
    for &(before, after) in ONE_BASED_MODES {
        let mut out = String::with_capacity(text.len());
        let mut rest = text.as_str();
        while let Some(at) = rest.find(before) {
            let start = at + before.len();
            let digits = rest[start..]
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(rest.len() - start);
            let number = rest[start..start + digits].parse::<usize>();
            match number {
                Ok(n) if n >= 1 && rest[start + digits..].starts_with(after) => {
                    out.push_str(&rest[..at]);
                    // `the mode-2 factor` reads `the factor of mode 1`.
                    if before == "the mode-" {
                        out.push_str(&format!("the factor of mode {}", n - 1));
                        rest = &rest[start + digits + " factor".len()..];
                    } else {
                        out.push_str(&format!("{before}{}", n - 1));
                        rest = &rest[start + digits..];
                    }
                }
                _ => {
                    out.push_str(&rest[..start]);
                    rest = &rest[start..];
                }
            }
        }
        out.push_str(rest);
        text = out;
    }
    text
}
