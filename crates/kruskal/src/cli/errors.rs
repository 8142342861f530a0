//! How the program prints an error: one line, each cause once, with advice
//! that fits the command.

use kruskal_device::DeviceError;

/// The error's chain as one line, outermost context first. A cause whose
/// text its parent already printed is skipped: many error types (ours,
/// std's, cudarc's) both name their source in their message and return it
/// from `source()`, and printing every link would say each of them twice
/// (`Is a directory (os error 21): Is a directory (os error 21)`).
pub fn error_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if text.is_empty() || line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// True when the error says no GPU can be used at all (no CUDA library,
/// no device), where the advice depends on the command that was run.
pub fn is_no_gpu(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(
            c.downcast_ref::<DeviceError>(),
            Some(DeviceError::MissingLibrary { .. } | DeviceError::NoDevice { .. })
        )
    })
}

/// The value of `flag` among the words typed (`--gpus 2` or `--gpus=2`).
fn flag_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter().enumerate().find_map(|(k, a)| {
        if a == flag {
            args.get(k + 1).map(String::as_str)
        } else {
            a.strip_prefix(flag).and_then(|rest| rest.strip_prefix('='))
        }
    })
}

/// What to do instead when `command` (the subcommand's name, with `args`
/// the words typed after it) found no usable GPU: the options that asked
/// for one, to drop, rather than one the user may already have given.
pub fn no_gpu_advice(command: &str, args: &[String]) -> String {
    match command {
        "cpd" | "mttkrp" => {
            if args.iter().any(|a| a == "--distributed") {
                return "install the NVIDIA driver: --distributed runs one process per GPU".into();
            }
            let mut asked = Vec::new();
            if let Some(n) = flag_value(args, "--gpus") {
                asked.push(format!("--gpus {n}"));
            }
            let backend = flag_value(args, "--backend");
            if backend == Some("gpu") {
                asked.push("--backend gpu".into());
            }
            if !asked.is_empty() {
                format!(
                    "install the NVIDIA driver, or drop {} to run on the CPU",
                    asked.join(" and ")
                )
            } else if backend == Some("cpu") {
                "install the NVIDIA driver".into()
            } else {
                "install the NVIDIA driver, or use --backend cpu".into()
            }
        }
        "info" => "install the NVIDIA driver; without --gpu, info shows the tensor".into(),
        "check" => "install the NVIDIA driver; without --gpu, check tests the CPU engines".into(),
        _ => "install the NVIDIA driver; this needs a CUDA GPU".into(),
    }
}

/// The line the program prints for an error of `command`, run with
/// `args` (the words after the subcommand).
pub fn report(command: &str, args: &[String], e: &anyhow::Error) -> String {
    let line = error_line(e);
    if is_no_gpu(e) {
        format!("{line}; {}", no_gpu_advice(command, args))
    } else {
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn a_cause_already_in_its_parents_message_is_said_once() {
        let io = std::io::Error::new(std::io::ErrorKind::IsADirectory, "Is a directory");
        let e = kruskal_formats::FormatError::Io {
            path: "/tmp/x".into(),
            source: io,
        };
        let e = anyhow::Error::new(e);
        assert_eq!(error_line(&e), "/tmp/x: Is a directory");
        let e = e.context("reading the tensor");
        assert_eq!(error_line(&e), "reading the tensor: /tmp/x: Is a directory");
    }

    #[test]
    fn distinct_causes_are_all_kept() {
        let e = Err::<(), _>(std::io::Error::other("disk full"))
            .context("writing mode-1.npy")
            .unwrap_err();
        assert_eq!(error_line(&e), "writing mode-1.npy: disk full");
    }

    #[test]
    fn no_gpu_advice_fits_the_command() {
        let e = anyhow::Error::new(DeviceError::NoDevice {
            ordinal: 0,
            count: 0,
        });
        let words = |line: &str| -> Vec<String> { line.split(' ').map(String::from).collect() };
        let cpd = report("cpd", &words("x.tns"), &e);
        assert!(cpd.ends_with("use --backend cpu"), "{cpd}");
        // The advice names what asked for a GPU, never what was given.
        for (typed, advice) in [
            ("x.tns --gpus 2", "or drop --gpus 2 to run on the CPU"),
            (
                "x.tns --gpus 2 --backend cpu",
                "or drop --gpus 2 to run on the CPU",
            ),
            ("x.tns --gpus=all", "or drop --gpus all to run on the CPU"),
            (
                "x.tns --backend gpu",
                "or drop --backend gpu to run on the CPU",
            ),
            (
                "x.tns --backend=gpu --gpus 2",
                "or drop --gpus 2 and --backend gpu to run on the CPU",
            ),
            ("x.tns --backend cpu", "install the NVIDIA driver"),
            (
                "x.ktns --distributed",
                "--distributed runs one process per GPU",
            ),
        ] {
            let line = report("cpd", &words(typed), &e);
            assert!(line.ends_with(advice), "{typed}: {line}");
            if typed.contains("--backend cpu") {
                assert!(!line.contains("use --backend cpu"), "{typed}: {line}");
            }
        }
        for command in ["info", "check"] {
            let line = report(command, &words("--gpu"), &e);
            assert!(!line.contains("--backend"), "{line}");
            assert!(line.contains("without --gpu"), "{line}");
        }
        let other = anyhow::anyhow!("something else");
        assert_eq!(report("cpd", &[], &other), "something else");
    }

    #[test]
    fn a_device_error_inside_the_decompositions_is_found_and_said_once() {
        // The decomposition carries the device's error as its kind, not as
        // text, so the advice finds it.
        let e = anyhow::Error::new(kruskal_cpd::CpdError::from(DeviceError::NoDevice {
            ordinal: 0,
            count: 0,
        }));
        assert_eq!(
            report("cpd", &[], &e),
            "no CUDA GPU 0 (the driver reports 0 device(s)); install the NVIDIA driver, or use \
             --backend cpu"
        );
    }
}
