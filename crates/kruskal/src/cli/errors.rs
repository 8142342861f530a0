//! How the program prints an error: one line, the error and its causes
//! joined by ": " (each error of the workspace keeps its causes out of its
//! own message, so each is said once), with advice that fits the command.

use kruskal::cpd::CpdError;
use kruskal::harness::CheckError;
use kruskal::measure::MeasureError;
use kruskal_device::DeviceError;
use kruskal_formats::FormatError;

/// The error's chain as one line, outermost context first, joined by ": "
/// (as anyhow's `{:#}` does), with the options the library names written
/// as the command line's flags.
pub fn error_line(e: &anyhow::Error) -> String {
    e.chain()
        .map(
            |link| match (cpd_error(link), link.downcast_ref::<FormatError>()) {
                (Some(c), _) => c.message(&kruskal::console::flag),
                (None, Some(f)) => f.message(&kruskal::console::flag),
                (None, None) => link.to_string(),
            },
        )
        .collect::<Vec<_>>()
        .join(": ")
}

/// The decomposition's error `e` is or passes on unchanged.
fn cpd_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a CpdError> {
    e.downcast_ref::<CpdError>().or_else(|| {
        e.downcast_ref::<MeasureError>()
            .and_then(MeasureError::cpd_error)
    })
}

/// The device's error `e` is or passes on unchanged (a transparent
/// wrapper is not a link of its own in the chain).
fn device_error<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a DeviceError> {
    if let Some(d) = e.downcast_ref::<DeviceError>() {
        Some(d)
    } else if let Some(c) = e.downcast_ref::<CpdError>() {
        c.device_error()
    } else if let Some(m) = e.downcast_ref::<MeasureError>() {
        m.device_error()
    } else {
        e.downcast_ref::<CheckError>()
            .and_then(CheckError::device_error)
    }
}

/// The link of `e` that says no GPU can be used at all (no CUDA library,
/// no device), if any: the advice then depends on the command that was
/// run.
fn no_gpu_error(e: &anyhow::Error) -> Option<&DeviceError> {
    e.chain().find_map(|c| {
        device_error(c).filter(|d| {
            matches!(
                d,
                DeviceError::MissingLibrary { .. } | DeviceError::NoDevice { .. }
            )
        })
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
/// `hidden`: the value of `CUDA_VISIBLE_DEVICES` when it hid every GPU
/// the driver has (the advice is then to unset it, not to install the
/// driver).
pub fn no_gpu_advice(command: &str, args: &[String], hidden: Option<&str>) -> String {
    let fix = match hidden {
        Some(value) => format!("CUDA_VISIBLE_DEVICES={value:?} hides every GPU: unset it"),
        None => "install the NVIDIA driver".to_string(),
    };
    match command {
        "cpd" | "mttkrp" => {
            if args.iter().any(|a| a == "--distributed") {
                return format!("{fix}: --distributed runs one process per GPU");
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
                format!("{fix}, or drop {} to run on the CPU", asked.join(" and "))
            } else if backend == Some("cpu") {
                fix
            } else {
                format!("{fix}, or use --backend cpu")
            }
        }
        "info" => format!("{fix}; without --gpu, info shows the tensor"),
        "check" => format!("{fix}; without --gpu, check tests the CPU engines"),
        _ => format!("{fix}; this needs a CUDA GPU"),
    }
}

/// The line the program prints for an error of `command`, run with
/// `args` (the words after the subcommand).
pub fn report(command: &str, args: &[String], e: &anyhow::Error) -> String {
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    report_with(command, args, e, visible.as_deref())
}

/// [`report`] with `visible` for the value of `CUDA_VISIBLE_DEVICES`.
fn report_with(command: &str, args: &[String], e: &anyhow::Error, visible: Option<&str>) -> String {
    let line = error_line(e);
    match no_gpu_error(e) {
        Some(no_gpu) => {
            // The driver answered and saw no device while the variable
            // was set: the variable hid them.
            let none_seen = matches!(no_gpu, DeviceError::NoDevice { count: 0, .. });
            let hidden = visible.filter(|_| none_seen);
            format!("{line}; {}", no_gpu_advice(command, args, hidden))
        }
        None => line,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    #[test]
    fn each_cause_is_said_once() {
        let io = std::io::Error::new(std::io::ErrorKind::IsADirectory, "Is a directory");
        let e = kruskal_formats::FormatError::Io {
            path: "/tmp/x".into(),
            error: io,
        };
        let e = anyhow::Error::new(e);
        assert_eq!(error_line(&e), "/tmp/x: Is a directory");
        let e = e.context("reading the tensor");
        assert_eq!(error_line(&e), "reading the tensor: /tmp/x: Is a directory");
    }

    /// Fails if any message of the chain repeats the text of its cause:
    /// [`error_line`] joins the chain as it is and relies on this.
    fn assert_each_cause_said_once(e: &anyhow::Error) {
        let links: Vec<String> = e.chain().map(ToString::to_string).collect();
        for pair in links.windows(2) {
            assert!(
                !pair[0].contains(&pair[1]),
                "{:?} repeats its cause {:?} (chain {links:?})",
                pair[0],
                pair[1]
            );
        }
    }

    /// Every error type of the workspace with a cause, built the ways the
    /// program meets them (a driver's error is left out: its text comes
    /// from the CUDA library, which a machine without one cannot load).
    #[test]
    fn no_error_of_the_program_repeats_its_cause() {
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory");
        let format = || kruskal_formats::FormatError::Io {
            path: "/tmp/x.tns".into(),
            error: io(),
        };
        let member = || DeviceError::GroupMember {
            gpu: 1,
            name: "NVIDIA H100".into(),
            what: "the MTTKRP of mode 2".into(),
            source: Some(kruskal_device::MemberError::new(DeviceError::OutOfMemory {
                what: "the output".into(),
                needed: 2048,
                free: 1024,
            })),
        };
        let member_line = "GPU 1 (NVIDIA H100): the MTTKRP of mode 2: out of GPU memory: the output needs 2048 \
             bytes, 1024 are free";
        let cases: Vec<(anyhow::Error, String)> = vec![
            (
                format().into(),
                "/tmp/x.tns: No such file or directory".into(),
            ),
            (
                kruskal::cpu::CpuError::from(kruskal::partition::PartitionError::from(format()))
                    .into(),
                "/tmp/x.tns: No such file or directory".into(),
            ),
            (member().into(), member_line.into()),
            (
                DeviceError::GroupMember {
                    gpu: 0,
                    name: "NVIDIA H100".into(),
                    what: "the exchange did not finish within 60 s".into(),
                    source: None,
                }
                .into(),
                "GPU 0 (NVIDIA H100): the exchange did not finish within 60 s".into(),
            ),
            (
                CpdError::from(kruskal::cpu::CpuError::from(format())).into(),
                "backend: /tmp/x.tns: No such file or directory".into(),
            ),
            (CpdError::from(member()).into(), member_line.into()),
            (
                MeasureError::from(CpdError::from(member())).into(),
                member_line.into(),
            ),
            (MeasureError::from(member()).into(), member_line.into()),
            (
                anyhow::Error::new(CheckError::from(member())).context("checking"),
                format!("checking: {member_line}"),
            ),
            (
                CheckError::Io {
                    path: "/tmp/data".into(),
                    error: io(),
                }
                .into(),
                "listing /tmp/data: No such file or directory".into(),
            ),
            (
                MeasureError::from(kruskal::cpu::CpuError::from(format())).into(),
                "/tmp/x.tns: No such file or directory".into(),
            ),
            (
                kruskal_launch::LaunchError::Io {
                    what: "connecting to rank 0".into(),
                    error: io(),
                }
                .into(),
                "connecting to rank 0: No such file or directory".into(),
            ),
            (
                kruskal::tune::TuneError::Generate {
                    spec: "nell-2@1e6".into(),
                    error: format(),
                }
                .into(),
                "generating nell-2@1e6: /tmp/x.tns: No such file or directory".into(),
            ),
        ];
        for (e, line) in &cases {
            assert_each_cause_said_once(e);
            assert_eq!(&error_line(e), line);
        }
        // A group member's out-of-memory error is found by its kind.
        let e: anyhow::Error = MeasureError::from(CpdError::from(member())).into();
        assert!(e.chain().any(|c| matches!(
            c.downcast_ref::<DeviceError>(),
            Some(DeviceError::OutOfMemory { .. })
        )));
        // And a device's error passed on by a wrapper still gets its advice.
        let no_gpu = || DeviceError::NoDevice {
            ordinal: 0,
            count: 0,
        };
        for e in [
            anyhow::Error::new(MeasureError::from(CpdError::from(no_gpu()))),
            anyhow::Error::new(CheckError::from(no_gpu())).context("checking"),
        ] {
            assert!(no_gpu_error(&e).is_some(), "{e:#}");
        }
    }

    #[test]
    fn the_librarys_options_are_written_as_flags() {
        use kruskal::cpd::OptionName;
        let e = anyhow::Error::new(CpdError::option(OptionName::Rank, "must be at least 1"));
        assert_eq!(error_line(&e), "--rank must be at least 1");
        let e = anyhow::Error::new(MeasureError::from(CpdError::option_value(
            OptionName::Kernel,
            "coo",
            "runs on the GPU only",
        )))
        .context("measuring");
        assert_eq!(
            error_line(&e),
            "measuring: --kernel coo runs on the GPU only"
        );
        let e = anyhow::Error::new(CpdError::Memory {
            message: "the run needs 9 GB".into(),
            sparse_modes: Some("mode 2 has dimension 9 but 1 indices occur".into()),
        });
        assert!(
            error_line(&e).ends_with(": --compact relabels each mode to the indices that occur"),
            "{}",
            error_line(&e)
        );
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
        let report =
            |command: &str, args: &[String], e: &anyhow::Error| report_with(command, args, e, None);
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
        // No device seen with CUDA_VISIBLE_DEVICES set: the variable is
        // named, not the driver; a missing library still asks for it.
        let hidden = report_with("cpd", &words("x.tns --backend gpu"), &e, Some(""));
        assert!(
            hidden.ends_with(
                "CUDA_VISIBLE_DEVICES=\"\" hides every GPU: unset it, or drop --backend gpu to \
                 run on the CPU"
            ),
            "{hidden}"
        );
        let missing = anyhow::Error::new(DeviceError::MissingLibrary {
            library: "driver",
            tried: vec!["libcuda.so".into()],
        });
        let line = report_with("check", &words("--gpu"), &missing, Some("3"));
        assert!(line.contains("install the NVIDIA driver"), "{line}");
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
