//! The library's messages in Python's words.
//!
//! An option of a decomposition is named by the library neutrally
//! ([`kruskal_cpd::OptionName`]) and written here as its keyword
//! ([`keyword`]: `rank`, `kernel="coo"`, `iters=0`), in errors and warnings
//! alike. What remains rewritten as text: the messages of the file readers
//! and of the tuning model, which still name command-line options (`use
//! --pattern`, `--kernel fcoo --threadlen 8`), and modes, which the library
//! counts from 1, as FROSTT files and the model's `mode-<n>.npy` names do,
//! where a Python user counts from 0, as `mttkrp(X, factors, mode)` and
//! `factors[n]` do. Every library message that reaches Python as text (an
//! exception, a reader's warning, a note in `info["notes"]`) passes
//! through [`python_words`], which rewrites it by the two tables below
//! (the decomposition's warnings are data, written with modes from 0); the
//! command line's own messages stay as they are.

use kruskal_cpd::OptionName;

/// An option as a keyword of `kruskal.cp_als` (the neutral name), with
/// the value given: a number as it is (`iters=0`), a word as a string
/// (`kernel="coo"`).
pub fn keyword(option: OptionName, value: Option<&str>) -> String {
    match value {
        Some(v) if is_number(v) => format!("{option}={v}"),
        Some(v) => format!("{option}=\"{v}\""),
        None => option.name().to_string(),
    }
}

/// How a keyword's value is written in Python.
#[derive(Clone, Copy)]
enum Spelling {
    /// A flag without a value: `--pattern` is `pattern=True`.
    Switch,
    /// One of these words follows, as a string (`--kernel coo` is
    /// `kernel="coo"`).
    Word(&'static [&'static str]),
    /// A list of dimensions (`--dims 300,200,100` is `dims=(300, 200, 100)`).
    Dims,
    /// Not a keyword of the Python API (a launch parameter the tuning model
    /// chose, say): the option's name without its dashes.
    Plain,
}

/// The command line's options the readers' and the tuning model's messages
/// name, with the keyword of `kruskal.cp_als`, `kruskal.read` or
/// `kruskal.mttkrp` that does the same.
const KEYWORDS: &[(&str, &str, Spelling)] = &[
    (
        "--kernel",
        "kernel",
        Spelling::Word(&[
            "auto", "sorted", "fcoo", "flycoo", "hicoo", "csf", "coo", "shard",
        ]),
    ),
    ("--pattern", "pattern", Spelling::Switch),
    ("--zero-based", "zero_based", Spelling::Switch),
    ("--values-are-data", "values_are_data", Spelling::Switch),
    ("--dims", "dims", Spelling::Dims),
    ("--threadlen", "threadlen", Spelling::Plain),
    ("--kappa", "kappa", Spelling::Plain),
    ("--block-bits", "block_bits", Spelling::Plain),
];

/// Phrases of the library's messages that count modes from 1: the text
/// before the number and after it. The number becomes one less.
const ONE_BASED_MODES: &[(&str, &str)] = &[
    ("the mode-", " factor holds"),
    ("factor of mode ", " "),
    ("mode ", " has dimension"),
    ("mode ", " rows read"),
    ("mode ", " all rows"),
];

/// `text` (a library message) with every command-line option written as
/// the Python keyword and every mode counted from 0.
pub fn python_words(text: &str) -> String {
    renumber_modes(&keywords(text))
}

/// The word at the start of `rest` (up to a space, or punctuation that ends
/// it), and what follows it.
fn next_word(rest: &str) -> (&str, &str) {
    let end = rest
        .find(|c: char| c.is_whitespace() || matches!(c, ':' | ';' | ')' | '(' | '\''))
        .unwrap_or(rest.len());
    // A sentence's comma or full stop is not part of the value.
    let word = rest[..end].trim_end_matches([',', '.']);
    (word, &rest[word.len()..])
}

fn is_number(word: &str) -> bool {
    !word.is_empty() && word.parse::<f64>().is_ok()
}

fn keywords(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("--") {
        out.push_str(&rest[..at]);
        let after = &rest[at..];
        let end = 2 + after[2..]
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'))
            .unwrap_or(after.len() - 2);
        let (flag, tail) = after.split_at(end);
        let Some(&(_, keyword, spelling)) = KEYWORDS.iter().find(|(f, _, _)| *f == flag) else {
            // An option of no keyword: its name alone (a bare `--` stays).
            let name = flag.trim_start_matches('-');
            out.push_str(if name.is_empty() { flag } else { name });
            rest = tail;
            continue;
        };
        // `--kernel=coo` is written as `--kernel coo`.
        let (value, after_value) = match tail.strip_prefix(' ').or(tail.strip_prefix('=')) {
            Some(v) => next_word(v),
            None => ("", tail),
        };
        let taken = match spelling {
            Spelling::Switch => {
                out.push_str(&format!("{keyword}=True"));
                false
            }
            Spelling::Plain if is_number(value) => {
                out.push_str(&format!("{keyword} {value}"));
                true
            }
            Spelling::Word(words) if words.contains(&value) => {
                out.push_str(&format!("{keyword}=\"{value}\""));
                true
            }
            Spelling::Dims
                if !value.is_empty() && value.split(',').all(|d| d.parse::<u64>().is_ok()) =>
            {
                let dims: Vec<&str> = value.split(',').collect();
                let comma = if dims.len() == 1 { "," } else { "" };
                out.push_str(&format!("{keyword}=({}{comma})", dims.join(", ")));
                true
            }
            _ => {
                out.push_str(keyword);
                false
            }
        };
        rest = if taken { after_value } else { tail };
    }
    out.push_str(rest);
    out
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
